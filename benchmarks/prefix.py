"""`python -m benchmarks prefix`: what automatic prefix caching buys, on the demo cluster.

Starts a local Ray and deploys the demo application (the random-weight demo model, 2048
positions) three times: one replica with the prefix cache on, one with it off
(`engine.enable_prefix_caching=false`), two replicas with it on (affinity routing). Against
each it runs the load generator's (`lorafleet bench http`) scenarios that share prefixes:

  shared-prefix  every adapter has its own ~1000-token system prompt; each request adds a
                 unique ~32-token user message (adapters uniform)
  multi-turn     conversations of 4 turns on one adapter each, every turn the previous
                 prompt + its answer + a new ~64-token message; 16 conversations at a time

and compares, per scenario, against the targets of benchmarks/targets.toml [prefix]:

  ttft_p50_ratio            TTFT p50, cache on / off (1 replica)
  output_tok_s_ratio        output tok/s, cache on / off (1 replica)
  replica_hit_rate_ratio    prefix hit rate, 2 replicas / 1 replica

Every adapter has a device slot, so adapter loads stay out of the TTFTs. The hit rate is
the client's (usage.prompt_tokens_details.cached_tokens over prompt_tokens), else the
replicas' (their prefix counters); where the server reports neither, it is unknown.

    python -m benchmarks prefix               # JSON and plot into benchmarks/results/
    python -m benchmarks prefix --quick       # a smoke run of every setup: ~2 minutes,
                                              # each deployment starting in 20-30 s
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace

from benchmarks import harness
from benchmarks.harness import RunResult, Sizes, pct
from cluster import serving
from cluster.bench.http import LoadOptions
from cluster.bench.stats import ms

SCENARIOS = ("shared-prefix", "multi-turn")
DEFAULT_JSON = harness.RESULTS / "prefix.json"
DEFAULT_PLOT = harness.RESULTS / "prefix_ttft.png"


@dataclass(frozen=True)
class Setup:
    name: str
    replicas: int
    cache: bool
    what: str


SETUPS = (
    Setup("cache-on", 1, True, "1 replica, prefix cache on"),
    Setup("cache-off", 1, False, "1 replica, engine.enable_prefix_caching=false"),
    Setup("cache-on-2r", 2, True, "2 replicas (affinity routing), prefix cache on"),
)
SETUP_NAMES = tuple(s.name for s in SETUPS)
ON, OFF, TWO = SETUP_NAMES


@dataclass(frozen=True)
class Run:
    setup: Setup
    scenario: str


# every adapter resident (17 slots, the base's included); the warm-up is per replica: each
# replica computes each prefix it gets once, so a cold start of 2 replicas has twice the
# first computations of 1; prompt_tokens: shared-prefix's message after the prefix; KV: 32k
# tokens of the demo model per replica
FULL = Sizes(adapters=16, slots=17, prefix_tokens=1000, prompt_tokens=32, turn_tokens=64,
             turns=4, max_tokens=32, requests=96, warmup=32, concurrency=16)  # fmt: skip
QUICK = Sizes(adapters=2, slots=3, prefix_tokens=64, prompt_tokens=8, turn_tokens=8, turns=2,
              max_tokens=4, requests=8, warmup=2, concurrency=2, kv_cache_bytes=16 * 2**20,
              settle_s=0.75)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    plot = "TTFT CDFs with and without the cache, a panel per scenario"
    harness.add_output_arguments(p, DEFAULT_JSON, DEFAULT_PLOT, plot)
    p.add_argument("--setups", type=harness.subset_of(SETUP_NAMES), default=SETUP_NAMES,
                   metavar="NAME,...",
                   help="Deploy only these setups, comma-separated (default all: "
                        f"{','.join(s.name for s in SETUPS)}); a comparison needs all "
                        "three.")  # fmt: skip
    p.add_argument("--scenarios", type=harness.subset_of(SCENARIOS), default=SCENARIOS,
                   metavar="NAME,...",
                   help=f"Run only these (default all: {','.join(SCENARIOS)}).")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the cluster it starts.")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray it starts.")


def run(args: argparse.Namespace) -> int:
    json_path, plot_path = harness.output_paths(args, DEFAULT_JSON, DEFAULT_PLOT)
    sizes = QUICK if args.quick else FULL
    setups = tuple(s for s in SETUPS if s.name in args.setups)
    results = measure_all(sizes, args.port, args.num_cpus, setups, args.scenarios)
    meta = {**harness.run_meta(args), "setups": {s.name: asdict(s) for s in setups},
            "sizes": sizes.to_json()}  # fmt: skip
    comparisons = compare(results)
    print(report(results, comparisons, meta))
    harness.write_json(json_path, _json(results, comparisons, meta))
    if plot_path is not None:
        panels = {
            s: {r.run.setup.name: r.ttfts_s for r in results if r.run.scenario == s and r.ttfts_s}
            for s in args.scenarios
        }
        harness.plot_ttft_cdfs(panels, plot_path)
        print(f"wrote {plot_path}")
    failed = [r for r in results if not r.summary["all"]["ok"]]
    if failed:
        names = ", ".join(f"{r.run.setup.name} / {r.run.scenario}" for r in failed)
        print(f"{args.command}: error: every request of {names} failed: "
              f"{failed[0].summary['errors'][:1]}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


# -- the runs ---------------------------------------------------------------------------------


def measure_all(
    sizes: Sizes,
    port: int,
    cpus: int,
    setups: tuple[Setup, ...] = SETUPS,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> list[RunResult]:
    """Every setup deployed in turn (the last one deleted first: each starts with an empty
    cache and no replica of another setup still busy), both scenarios against each."""
    url = f"http://127.0.0.1:{port}"
    results = []
    with harness.local_ray(cpus):
        for setup in setups:
            config = serve_config(setup, sizes, port)
            print(f"deploying {setup.name}: {setup.what}", flush=True)
            t0 = time.perf_counter()
            serving.deploy(config)
            print(f"  running after {time.perf_counter() - t0:.0f} s", flush=True)
            for scenario in scenarios:
                label = f"{setup.name} / {scenario}"
                options = load_options(sizes, scenario, url, label, setup.replicas)
                results.append(harness.load_run(Run(setup, scenario), options))
                print(f"  {_run_line(results[-1])}", flush=True)
            if setup != setups[-1]:  # the last one goes with Ray
                serving.remove(config)
    return results


def serve_config(setup: Setup, sizes: Sizes, port: int) -> dict:
    setting = f"engine.enable_prefix_caching={str(setup.cache).lower()}"
    return harness.demo_serve_config(replace(sizes, replicas=setup.replicas), port, [setting])


def load_options(
    sizes: Sizes, scenario: str, url: str, label: str, replicas: int = 1
) -> LoadOptions:
    shared = scenario == "shared-prefix"
    return harness.load_options(
        sizes, url, label, scenario=scenario, warmup_requests=sizes.warmup * replicas,
        prompt_tokens=sizes.prompt_tokens if shared else sizes.turn_tokens,
        prefix_tokens=sizes.prefix_tokens, turns=sizes.turns,
    )  # fmt: skip


# -- figures ----------------------------------------------------------------------------------


def hit_rate(summary: dict) -> float | None:
    """The client's prefix hit rate, else the replicas', else None (unknown)."""
    client = summary["all"]["prefix_hit_rate"]
    if client is not None:
        return client
    return (summary.get("server") or {}).get("prefix_hit_rate")


def compare(results: list[RunResult]) -> dict[str, dict]:
    """Per scenario: the on/off ratios, the 2-replica/1-replica hit-rate ratio, and each
    checked against its target (met None where a figure is missing)."""
    out = {}
    for scenario in SCENARIOS:
        by = {r.run.setup.name: r.summary for r in results if r.run.scenario == scenario}
        if not {ON, OFF, TWO} <= set(by):
            continue
        on, off = by[ON]["all"], by[OFF]["all"]
        hits = {name: hit_rate(by[name]) for name in (ON, OFF, TWO)}
        figures = {
            "ttft_p50_ratio": harness.ratio(on["ttft_p50_s"], off["ttft_p50_s"]),
            "output_tok_s_ratio": harness.ratio(on["output_tok_per_s"], off["output_tok_per_s"]),
            "hit_rate": hits,
            "replica_hit_rate_ratio": harness.ratio(hits[TWO], hits[ON]),
        }
        out[scenario] = {**figures, "targets": harness.check("prefix", figures)}
    return out


def report(results: list[RunResult], comparisons: dict[str, dict], meta: dict) -> str:
    """A markdown table of the runs, then each scenario's ratios against the targets."""
    s = meta["sizes"]
    lines = [
        f"Measured {meta['date']} on {harness.machine_line(meta['machine'])} with "
        f"`{meta['command']}`: the demo model, {s['adapters']} adapters (all resident); "
        f"shared-prefix: ~{s['prefix_tokens']} + {s['prompt_tokens']} + {s['max_tokens']} "
        f"tokens; multi-turn: {s['turns']} turns of ~{s['turn_tokens']} + {s['max_tokens']} "
        f"tokens; each run {s['requests']} requests after {s['warmup']} unmeasured, closed "
        f"loop at {s['concurrency']}.",
        "",
        "| scenario | setup | ok | TTFT p50 / p95 ms | out tok/s | prefix hit rate "
        "(client / server) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: SCENARIOS.index(r.run.scenario)):
        a, server = r.summary["all"], r.summary.get("server") or {}
        lines.append(
            f"| {r.run.scenario} | {r.run.setup.name} | {a['ok']}/{a['requests']} "
            f"| {ms(a['ttft_p50_s'], 0)} / {ms(a['ttft_p95_s'], 0)} "
            f"| {a['output_tok_per_s']:.1f} "
            f"| {pct(a['prefix_hit_rate'])} / {pct(server.get('prefix_hit_rate'))} |"
        )
    lines.append("")
    for scenario, c in comparisons.items():
        t = c["targets"]
        lines.append(
            f"- {scenario}: TTFT p50 on/off {harness.verdict(t['ttft_p50_ratio'])}; output tok/s "
            f"on/off {harness.verdict(t['output_tok_s_ratio'])}; hit rate 2 replicas / 1 "
            f"{harness.verdict(t['replica_hit_rate_ratio'])}"
        )
    if any(hit_rate(r.summary) is None for r in results if r.run.setup.cache):
        lines.append(
            "- hit rate unknown where '-': the server sent no "
            "usage.prompt_tokens_details.cached_tokens and no prefix counters"
        )
    return "\n".join(lines)


def _run_line(r: RunResult) -> str:
    a = r.summary["all"]
    return (
        f"{r.run.setup.name} / {r.run.scenario}: {a['ok']}/{a['requests']} ok, TTFT p50 "
        f"{ms(a['ttft_p50_s'], 0)} ms, {a['output_tok_per_s']:.1f} out tok/s, prefix hit "
        f"rate {pct(hit_rate(r.summary))}"
    )


def _json(results: list[RunResult], comparisons: dict[str, dict], meta: dict) -> dict:
    return {
        **meta,
        "comparisons": comparisons,
        "runs": [
            {
                "setup": r.run.setup.name,
                "scenario": r.run.scenario,
                "summary": r.summary,
                "ttfts_s": r.ttfts_s,
            }
            for r in results
        ],
    }


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
