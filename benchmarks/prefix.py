"""`lorafleet bench prefix`: what automatic prefix caching buys, on the demo cluster.

Starts a local Ray and deploys the demo application (the random-weight demo model, 2048
positions) three times: one replica with the prefix cache on, one with it off
(`engine.enable_prefix_caching=false`), two replicas with it on (affinity routing). Against
each it runs the `bench http` scenarios that share prefixes:

  shared-prefix  every adapter has its own ~1000-token system prompt; each request adds a
                 unique ~32-token user message (adapters uniform)
  multi-turn     conversations of 4 turns on one adapter each, every turn the previous
                 prompt + its answer + a new ~64-token message; 16 conversations at a time

and compares, per scenario (targets of issue 20):

  TTFT p50, cache on / off (1 replica)             <= 0.35
  output tok/s, cache on / off (1 replica)         >= 1.5
  prefix hit rate, 2 replicas / 1 replica          within 10 % of 1

Every adapter has a device slot, so adapter loads stay out of the TTFTs. The hit rate is
the client's (usage.prompt_tokens_details.cached_tokens over prompt_tokens), else the
replicas' (their prefix counters); where the server reports neither, it is unknown.

    lorafleet bench prefix                    # JSON and plot into cluster/bench/results/
    lorafleet bench prefix --quick            # a smoke run of every setup: ~2 minutes,
                                              # each deployment starting in 20-30 s
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster import serving
from cluster.bench.http import LoadOptions, run_load
from cluster.bench.stats import ms, num_cpus, output_paths
from cluster.bench.suite import DEFAULT_OUT, demo_serve_config, plot_ttft_cdfs, start_ray, stop_ray

SCENARIOS = ("shared-prefix", "multi-turn")
DEFAULT_JSON = DEFAULT_OUT / "prefix.json"
DEFAULT_PLOT = DEFAULT_OUT / "prefix_ttft.png"


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
ON, OFF, TWO = (s.name for s in SETUPS)


@dataclass(frozen=True)
class Targets:
    ttft_p50_ratio_max: float = 0.35  # cache on / off
    tok_s_ratio_min: float = 1.5  # cache on / off
    replica_hit_rate_tolerance: float = 0.10  # |2 replicas / 1 replica - 1|


TARGETS = Targets()


@dataclass(frozen=True)
class Sizes:
    """How much load each run gets."""

    adapters: int = 16
    slots: int = 17  # per replica, base slot included: every adapter resident
    prefix_tokens: int = 1000  # shared-prefix: each adapter's system prompt
    suffix_tokens: int = 32  # shared-prefix: each request's own message
    turn_tokens: int = 64  # multi-turn: each turn's new message
    turns: int = 4
    max_tokens: int = 32
    requests: int = 96  # per run; multi-turn: turns
    # unmeasured, before each run, per replica: each replica computes each prefix it gets
    # once, so a cold start of 2 replicas has twice the first computations of 1
    warmup: int = 32
    concurrency: int = 16  # multi-turn: conversations
    kv_cache_bytes: int = 256 * 2**20  # per replica: 32k tokens of the demo model
    settle_s: float = 1.5  # wait for the replicas' counters (reported every 0.5 s)


QUICK = Sizes(adapters=2, slots=3, prefix_tokens=64, suffix_tokens=8, turn_tokens=8, turns=2,
              max_tokens=4, requests=8, warmup=2, concurrency=2, kv_cache_bytes=16 * 2**20,
              settle_s=0.75)  # fmt: skip


@dataclass
class RunResult:
    setup: Setup
    scenario: str
    summary: dict
    ttfts_s: list[float] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="Tiny loads: a smoke run of every setup and scenario (CI); writes "
                        "nothing unless --json or --plot say where.")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help=f"Write every figure here (default {DEFAULT_JSON}; with --quick, "
                        "none).")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None,
                   help=f"TTFT CDFs with and without the cache, a panel per scenario (default "
                        f"{DEFAULT_PLOT}; with --quick, none). Needs matplotlib (the bench "
                        "extra).")  # fmt: skip
    p.add_argument("--setups", type=_setups, default=SETUPS, metavar="NAME,...",
                   help="Deploy only these setups, comma-separated (default all: "
                        f"{','.join(s.name for s in SETUPS)}); a comparison needs all "
                        "three.")  # fmt: skip
    p.add_argument("--scenarios", type=_scenarios, default=SCENARIOS, metavar="NAME,...",
                   help=f"Run only these (default all: {','.join(SCENARIOS)}).")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the cluster it starts.")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray it starts.")


def _setups(names: str) -> tuple[Setup, ...]:
    by_name = {s.name: s for s in SETUPS}
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in by_name]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(by_name)}, not {names!r}")
    return tuple(s for s in SETUPS if s.name in chosen)


def _scenarios(names: str) -> tuple[str, ...]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen or any(n not in SCENARIOS for n in chosen):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SCENARIOS)}, not {names!r}")
    return tuple(s for s in SCENARIOS if s in chosen)


def run(args: argparse.Namespace) -> int:
    json_path, plot_path = output_paths(args, DEFAULT_JSON, DEFAULT_PLOT, "prefix")
    sizes = QUICK if args.quick else Sizes()
    results = measure_all(sizes, args.port, args.num_cpus, args.setups, args.scenarios)
    meta = _meta(sizes, args.quick, args.setups, args.scenarios)
    comparisons = compare(results)
    print(report(results, comparisons, meta))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_json(results, comparisons, meta), indent=2))
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        panels = {
            s: {r.setup.name: r.ttfts_s for r in results if r.scenario == s and r.ttfts_s}
            for s in args.scenarios
        }
        plot_ttft_cdfs(panels, plot_path)
        print(f"wrote {plot_path}")
    failed = [f"{r.setup.name} / {r.scenario}" for r in results if not r.summary["all"]["ok"]]
    if failed:
        first = next(r.summary["errors"] for r in results if not r.summary["all"]["ok"])
        print(f"lorafleet: error: every request of {', '.join(failed)} failed: {first[:1]}",
              file=sys.stderr)  # fmt: skip
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
    start_ray(cpus)
    try:
        for setup in setups:
            config = serve_config(setup, sizes, port)
            print(f"deploying {setup.name}: {setup.what}", flush=True)
            t0 = time.perf_counter()
            serving.deploy(config)
            print(f"  running after {time.perf_counter() - t0:.0f} s", flush=True)
            for scenario in scenarios:
                label = f"{setup.name} / {scenario}"
                options = load_options(sizes, scenario, url, label, setup.replicas)
                result = asyncio.run(run_load(options))
                ttfts = [r.ttft_s for r in result.records if r.ok and r.ttft_s is not None]
                results.append(RunResult(setup, scenario, result.summary(), ttfts))
                print(f"  {_run_line(results[-1])}", flush=True)
            if setup != setups[-1]:  # the last one goes with Ray
                serving.remove(config)
    finally:
        stop_ray()
    return results


def serve_config(setup: Setup, sizes: Sizes, port: int) -> dict:
    return demo_serve_config(
        replicas=setup.replicas,
        adapters=sizes.adapters,
        slots=sizes.slots,
        kv_cache_bytes=sizes.kv_cache_bytes,
        port=port,
        settings=[f"engine.enable_prefix_caching={str(setup.cache).lower()}"],
    )


def load_options(
    sizes: Sizes, scenario: str, url: str, label: str, replicas: int = 1
) -> LoadOptions:
    shared = scenario == "shared-prefix"
    return LoadOptions(
        url=url,
        scenario=scenario,
        concurrency=sizes.concurrency,
        num_requests=sizes.requests,
        warmup_requests=sizes.warmup * replicas,
        prompt_tokens=sizes.suffix_tokens if shared else sizes.turn_tokens,
        prefix_tokens=sizes.prefix_tokens,
        turns=sizes.turns,
        max_tokens=sizes.max_tokens,
        stats_settle_s=sizes.settle_s,
        label=label,
    )


# -- figures ----------------------------------------------------------------------------------


def hit_rate(summary: dict) -> float | None:
    """The client's prefix hit rate, else the replicas', else None (unknown)."""
    client = summary["all"]["prefix_hit_rate"]
    if client is not None:
        return client
    return (summary.get("server") or {}).get("prefix_hit_rate")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: list[RunResult], targets: Targets = TARGETS) -> dict[str, dict]:
    """Per scenario: the on/off ratios, the 2-replica/1-replica hit-rate ratio, and whether
    each meets its target (None where a figure is missing)."""
    out = {}
    for scenario in SCENARIOS:
        by = {r.setup.name: r.summary for r in results if r.scenario == scenario}
        if not {ON, OFF, TWO} <= set(by):
            continue
        on, off = by[ON]["all"], by[OFF]["all"]
        ttft = _ratio(on["ttft_p50_s"], off["ttft_p50_s"])
        tok_s = _ratio(on["output_tok_per_s"], off["output_tok_per_s"])
        hits = {name: hit_rate(by[name]) for name in (ON, OFF, TWO)}
        replicas = _ratio(hits[TWO], hits[ON])
        tolerance = targets.replica_hit_rate_tolerance
        out[scenario] = {
            "ttft_p50_ratio": ttft,
            "output_tok_s_ratio": tok_s,
            "hit_rate": hits,
            "replica_hit_rate_ratio": replicas,
            "met": {
                "ttft_p50_ratio": None if ttft is None else ttft <= targets.ttft_p50_ratio_max,
                "output_tok_s_ratio": None if tok_s is None else tok_s >= targets.tok_s_ratio_min,
                "replica_hit_rate_ratio": (
                    None if replicas is None else abs(replicas - 1) <= tolerance + 1e-12
                ),
            },
        }
    return out


def report(results: list[RunResult], comparisons: dict[str, dict], meta: dict) -> str:
    """A markdown table of the runs, then each scenario's ratios against the targets."""
    s, t = meta["sizes"], meta["targets"]
    lines = [
        f"Measured {meta['date']} on {meta['machine']} with `{meta['command']}`: the demo "
        f"model, {s['adapters']} adapters (all resident); shared-prefix: ~{s['prefix_tokens']} "
        f"+ {s['suffix_tokens']} + {s['max_tokens']} tokens; multi-turn: {s['turns']} turns "
        f"of ~{s['turn_tokens']} + {s['max_tokens']} tokens; each run {s['requests']} "
        f"requests after {s['warmup']} unmeasured, closed loop at {s['concurrency']}.",
        "",
        "| scenario | setup | ok | TTFT p50 / p95 ms | out tok/s | prefix hit rate "
        "(client / server) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: SCENARIOS.index(r.scenario)):
        a, server = r.summary["all"], r.summary.get("server") or {}
        lines.append(
            f"| {r.scenario} | {r.setup.name} | {a['ok']}/{a['requests']} "
            f"| {ms(a['ttft_p50_s'], 0)} / {ms(a['ttft_p95_s'], 0)} "
            f"| {a['output_tok_per_s']:.1f} "
            f"| {_pct(a['prefix_hit_rate'])} / {_pct(server.get('prefix_hit_rate'))} |"
        )
    lines.append("")
    for scenario, c in comparisons.items():
        met = c["met"]
        lines.append(
            f"- {scenario}: TTFT p50 on/off {_x(c['ttft_p50_ratio'])} (target <= "
            f"{t['ttft_p50_ratio_max']}: {_met(met['ttft_p50_ratio'])}); output tok/s on/off "
            f"{_x(c['output_tok_s_ratio'])} (>= {t['tok_s_ratio_min']}: "
            f"{_met(met['output_tok_s_ratio'])}); hit rate 2 replicas / 1 "
            f"{_x(c['replica_hit_rate_ratio'])} (within "
            f"{t['replica_hit_rate_tolerance']:.0%}: {_met(met['replica_hit_rate_ratio'])})"
        )
    if any(hit_rate(r.summary) is None for r in results if r.setup.cache):
        lines.append(
            "- hit rate unknown where '-': the server sent no "
            "usage.prompt_tokens_details.cached_tokens and no prefix counters"
        )
    return "\n".join(lines)


def _run_line(r: RunResult) -> str:
    a = r.summary["all"]
    return (
        f"{r.setup.name} / {r.scenario}: {a['ok']}/{a['requests']} ok, TTFT p50 "
        f"{ms(a['ttft_p50_s'], 0)} ms, {a['output_tok_per_s']:.1f} out tok/s, prefix hit "
        f"rate {_pct(hit_rate(r.summary))}"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _met(ok: bool | None) -> str:
    return "unknown" if ok is None else ("met" if ok else "NOT met")


def _meta(
    sizes: Sizes,
    quick: bool,
    setups: tuple[Setup, ...] = SETUPS,
    scenarios: tuple[str, ...] = SCENARIOS,
) -> dict:
    command = "lorafleet bench prefix" + (" --quick" if quick else "")
    if setups != SETUPS:
        command += f" --setups {','.join(s.name for s in setups)}"
    if scenarios != SCENARIOS:
        command += f" --scenarios {','.join(scenarios)}"
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {num_cpus()} CPUs, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}",
        "command": command,
        "setups": {s.name: asdict(s) for s in setups},
        "sizes": asdict(sizes),
        "targets": asdict(TARGETS),
    }


def _json(results: list[RunResult], comparisons: dict[str, dict], meta: dict) -> dict:
    return {
        **meta,
        "comparisons": comparisons,
        "runs": [
            {
                "setup": r.setup.name,
                "scenario": r.scenario,
                "summary": r.summary,
                "ttfts_s": r.ttfts_s,
            }
            for r in results
        ],
    }
