"""`python -m benchmarks many-adapters`: throughput and TTFT as the number of adapters grows.

Issue 21's benchmark. It builds N distinct rank-8 adapters of the random-weight demo model
(q_proj and v_proj, ~0.4 MB each; written once and cached on disk under a directory named
by their spec), starts a local Ray and the demo app with 2 replicas and the default engine
settings of configs/serve.yaml, the first adapter registered at start. Then, for each N in
ascending order:

  1. registers adapters until N are live, through POST /v1/load_lora_adapter (timed: the
     first 1,023 of them against their target);
  2. drives the load generator's (`lorafleet bench http`) uniform scenario over all N: 32
     concurrent requests of ~64 prompt tokens and 32 output tokens, after an unmeasured
     warm-up.

It reports output tok/s, TTFT p50/p99, tok/s(N) / tok/s(smallest N), and the registration
rate. After the last N it sends a few requests one at a time to adapters no request has
named yet: the TTFT of a registered adapter that no replica holds, then once more now
resident. Where the app has adapter resolvers (`adapter_resolvers`), the deployment turns
on the 'local' one over the adapters' directory and the same probes go to adapters never
registered: the TTFT of first-request resolution (target: <= 1.5x the registered one).

Targets: benchmarks/targets.toml [many_adapters].

    python -m benchmarks many-adapters                          # 16, 256, 1024, 4096
    python -m benchmarks many-adapters --adapters 16,256,1024   # ~8 minutes on 2 CPU cores
    python -m benchmarks many-adapters --quick                  # smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.harness import RunResult, Sizes, num, ratio
from cluster.bench.http import LoadOptions, build_prompt
from cluster.bench.stats import ms, percentile

DEFAULT_COUNTS = (16, 256, 1024, 4096)
DEFAULT_JSON = harness.RESULTS / "many_adapters.json"
DEFAULT_PLOT = harness.RESULTS / "many_adapters.png"
PREFIX = "many-"  # adapter names: many-00000, many-00001, ... (sorted = built order)
REGISTRATIONS_TIMED = 1023  # first_1023_registrations_s: the first this many at runtime


@dataclass(frozen=True)
class AdapterSpec:
    """The adapters: all alike but for their seeded weights (named by index)."""

    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # few modules: 4,096 stay under 2 GB


# the load at each N (the warm-up before each N's run); after the last N, cold_probes
# requests one at a time to adapters never requested
FULL = Sizes(concurrency=32, prompt_tokens=64, max_tokens=32, requests=192, warmup=32,
             register_concurrency=8, cold_probes=8)  # fmt: skip
QUICK = Sizes(concurrency=4, prompt_tokens=16, max_tokens=4, requests=8, warmup=2,
              register_concurrency=2, cold_probes=2, settle_s=0.5)  # fmt: skip
QUICK_COUNTS = (2, 4)


@dataclass
class Registration:
    """One step of registering: from `before` live adapters to `after`."""

    before: int
    after: int
    seconds: float
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.after - self.before

    @property
    def per_s(self) -> float | None:
        return self.count / self.seconds if self.seconds > 0 and self.count else None


@dataclass
class Step:
    """What one N gave: its registration step and its load run (`run` is N)."""

    registration: Registration
    load: RunResult
    load_average: list[float] | None = None  # the machine's, as the load run ended

    @property
    def adapters(self) -> int:
        return self.load.run

    @property
    def summary(self) -> dict:
        return self.load.summary


# -- the adapters -----------------------------------------------------------------------------


def adapter_names(n: int) -> list[str]:
    return [f"{PREFIX}{i:05d}" for i in range(n)]


def adapter_cache_dir(spec: AdapterSpec, cache_root: str | Path | None = None) -> Path:
    """Where this spec's adapters live: keyed by the demo model's spec and theirs, so a
    rerun finds them and another spec never mixes with them."""
    from cluster.demo.assets import DemoSpec

    root = cache_root or os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache/lorafleet"
    key = json.dumps({"model": DemoSpec().to_json(), "adapters": asdict(spec)}, sort_keys=True)
    return Path(root) / f"many-adapters-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_adapters(n: int, spec: AdapterSpec, out: Path) -> dict[str, Path]:
    """The first n adapters of `spec` under `out`, building only those not there yet (each
    written beside its place and renamed into it, so a directory present is complete).
    Their weights are seeded by name: the same files on every build."""
    from cluster.demo.assets import DemoSpec, write_adapter

    model, targets = DemoSpec(), tuple(sorted(spec.targets))
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in adapter_names(n):
        path = out / name
        if not path.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out))
            try:
                write_adapter(model, tmp / "a", name, spec.rank, spec.alpha, targets, False)
                for f in (tmp / "a").iterdir():  # safetensors writes owner-only files
                    f.chmod(0o644)
                (tmp / "a").chmod(0o755)
                os.rename(tmp / "a", path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        paths[name] = path
    return paths


# -- the run ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=counts_arg, default=DEFAULT_COUNTS, metavar="N,...",
                   help="Numbers of adapters to measure, comma-separated (default "
                        f"{','.join(map(str, DEFAULT_COUNTS))}); ratios are to the "
                        "smallest.")  # fmt: skip
    plot = "tok/s and TTFT against the number of adapters"
    harness.add_output_arguments(p, DEFAULT_JSON, DEFAULT_PLOT, plot)  # --quick: 2 and 4
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="Where the generated adapters are kept (default: a directory per "
                        "spec under $LORAFLEET_CACHE or ~/.cache/lorafleet).")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the cluster it starts.")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray it starts.")


def counts_arg(text: str) -> tuple[int, ...]:
    """'16,256,1024' -> (16, 256, 1024): positive, distinct, sorted ascending."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        message = f"expected numbers like 16,256,1024, not {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, not {text!r}")
    return tuple(counts)


def run(args: argparse.Namespace) -> int:
    json_path, plot_path = harness.output_paths(args, DEFAULT_JSON, DEFAULT_PLOT)
    counts = args.adapters
    if args.quick and counts == DEFAULT_COUNTS:
        counts = QUICK_COUNTS
    sizes, spec = (QUICK if args.quick else FULL), AdapterSpec()
    out = args.cache_dir or adapter_cache_dir(spec)
    t0 = time.perf_counter()
    resolve = resolvers_available()
    # with resolvers, the probes' adapters beyond the last N: on disk, never registered
    adapters = build_adapters(max(counts) + (sizes.cold_probes if resolve else 0), spec, out)
    print(f"{len(adapters)} adapters in {out} ({time.perf_counter() - t0:.1f} s)", flush=True)
    meta = _meta(sizes, spec, counts, args)
    url = f"http://127.0.0.1:{args.port}"
    with harness.local_ray(args.num_cpus):
        from cluster import serving

        config = serve_config(adapters, args.port, resolve)
        t0 = time.perf_counter()
        serving.deploy(config)
        print(f"demo app running after {time.perf_counter() - t0:.0f} s", flush=True)
        meta["load_average_before"] = harness.loadavg()
        steps, cold = asyncio.run(sweep(url, adapters, counts, sizes, resolve))
        meta["load_average_after"] = harness.loadavg()
    figures = compare(steps, cold)
    print(report(steps, figures, cold, meta))
    harness.write_json(json_path, _json(steps, figures, cold, meta))
    if plot_path is not None:
        plot(steps, plot_path, meta)
        print(f"wrote {plot_path}")
    failed = [s.adapters for s in steps if not s.summary["all"]["ok"] or s.registration.failed]
    if failed:
        print(f"{args.command}: error: registrations or every request failed at N = {failed}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def serve_config(adapters: dict[str, Path], port: int, resolve: bool = False) -> dict:
    """configs/serve.yaml on the demo model, 2 replicas, nothing else changed: the first
    adapter registered at start, its directory (every adapter's) an adapter root; with
    `resolve`, the 'local' resolver on (it acts only on names not registered)."""
    from cluster import serving

    first = next(iter(adapters))
    return serving.apply_overrides(
        serving.load_config(serving.DEFAULT_CONFIG),
        loras={first: str(adapters[first])},
        replicas=2,
        port=port,
        settings=["engine.model=demo", *(["store.resolvers=[local]"] if resolve else [])],
    )


def resolvers_available() -> bool:
    """Whether this build's app config has adapter resolvers (older ones measure without)."""
    from cluster import config

    store = getattr(config, "StoreConfig", None)  # the nested app config's store section
    return store is not None and "resolvers" in store.model_fields


async def sweep(
    url: str,
    adapters: dict[str, Path],
    counts: tuple[int, ...],
    sizes: Sizes,
    resolve: bool = False,
) -> tuple[list[Step], dict]:
    """Against a server with the first adapter live: for each N, register up to N, then
    the load. Then the cold-adapter probes, to adapters no request of the sweep named;
    with `resolve`, the same to the adapters after the last N (never registered: the
    server's resolver finds them), under "resolution". Adapters register in name order."""
    names = list(adapters)
    steps: list[Step] = []
    live, used = 1, {names[0]}  # used: adapters some request named (warm-ups included)
    for n in counts:
        todo = [(name, adapters[name]) for name in names[live:n]]
        registration = await register(url, todo, sizes.register_concurrency, before=live)
        live = max(live, n)
        rate = registration.per_s
        print(f"N={n}: registered {registration.count} in {registration.seconds:.1f} s"
              + (f" ({rate:.1f}/s)" if rate else "")
              + (f", {registration.failed} failed" if registration.failed else ""),
              flush=True)  # fmt: skip
        load = await harness.measure_load(n, load_options(url, n, sizes))
        used.update(load.summary["requests_per_model"])
        used.update(load.summary["warmup"]["requests_per_model"])
        steps.append(Step(registration, load, harness.loadavg()))
        a = load.summary["all"]
        print(f"  {a['ok']}/{a['requests']} ok, {a['output_tok_per_s']:.1f} out tok/s, TTFT "
              f"p50 {ms(a['ttft_p50_s'], 0)} ms p99 {ms(a['ttft_p99_s'], 0)} ms",
              flush=True)  # fmt: skip
    fresh = [n for n in names[: counts[-1]] if n not in used]
    cold = await cold_probes(url, fresh[: sizes.cold_probes], sizes)
    if resolve:
        unknown = names[counts[-1] : counts[-1] + sizes.cold_probes]
        cold["resolution"] = await cold_probes(url, unknown, sizes, first_index=20_000)
    return steps, cold


def load_options(url: str, n: int, sizes: Sizes) -> LoadOptions:
    return harness.load_options(sizes, url, f"{n} adapters", adapters=n, scenario="uniform")


async def register(
    url: str, todo: list[tuple[str, Path]], concurrency: int, before: int = 0
) -> Registration:
    """POST /v1/load_lora_adapter for each (name, path), `concurrency` at a time, timed
    from the first request to the last answer."""
    slots = asyncio.Semaphore(concurrency)
    errors: list[str] = []

    async def one(client: httpx.AsyncClient, name: str, path: Path) -> None:
        async with slots:
            body = {"lora_name": name, "lora_path": str(path)}
            try:
                r = await client.post(f"{url}/v1/load_lora_adapter", json=body)
                if r.status_code != 200:
                    errors.append(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")

    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, name, path) for name, path in todo))
        seconds = time.perf_counter() - t0
    return Registration(before, before + len(todo), seconds, len(errors), errors[:5])


async def cold_probes(url: str, names: list[str], sizes: Sizes, first_index: int = 10_000) -> dict:
    """One request at a time to each adapter no request has named yet (held by no replica;
    registered, or for the resolver to find), then at once again to the same (now
    resident): TTFT p50 of each. Prompts are request first_index's and on."""
    options = LoadOptions(url=url, prompt_tokens=sizes.prompt_tokens, max_tokens=sizes.max_tokens)
    cold, warm = [], []
    async with httpx.AsyncClient(timeout=options.timeout_s, trust_env=False) as client:
        for i, name in enumerate(names):
            for k, into in enumerate((cold, warm)):  # each request a prompt of its own
                prompt = build_prompt(first_index + 2 * i + k, sizes.prompt_tokens, options.seed)
                ttft = await first_text_s(client, url, name, prompt, options.max_tokens)
                if ttft is not None:
                    into.append(ttft)
    return {
        "adapters": names,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "cold_ttft_p50_s": percentile(cold, 50) if cold else None,
        "warm_ttft_p50_s": percentile(warm, 50) if warm else None,
    }


async def first_text_s(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> float | None:
    """Seconds to the first streamed text of one completion, read to its end; None if it
    failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0, first, done = time.perf_counter(), None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():  # bounded by the client's timeout
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                choices = json.loads(data).get("choices") or [{}]
                if first is None and choices[0].get("text"):
                    first = time.perf_counter() - t0
    except (httpx.HTTPError, ValueError):
        return None
    return first if done else None


# -- figures ----------------------------------------------------------------------------------


def compare(steps: list[Step], cold: dict | None = None) -> dict:
    """Per N: tok/s, TTFT p50/p99, tok/s and TTFT p50 over the smallest N's; the
    registration time of the first 1,023 runtime registrations (where the sweep reached
    1,024 adapters) and the rate over all of them; where `cold` has resolution probes,
    their first TTFT p50 over that of registered adapters no replica held; and the targets
    checked (those of a count the sweep did not reach unknown)."""
    first = steps[0].summary["all"] if steps else None
    per_n = {}
    for s in steps:
        a = s.summary["all"]
        per_n[s.adapters] = {
            "output_tok_per_s": a["output_tok_per_s"],
            "ttft_p50_s": a["ttft_p50_s"],
            "ttft_p99_s": a["ttft_p99_s"],
            "ok": a["ok"],
            "requests": a["requests"],
            "tok_s_ratio": ratio(a["output_tok_per_s"], first["output_tok_per_s"]),
            "ttft_p50_ratio": ratio(a["ttft_p50_s"], first["ttft_p50_s"]),
        }
    done = [s.registration for s in steps if s.registration.count]
    seconds = sum(r.seconds for r in done)
    count = sum(r.count for r in done)
    reached = [s for s in steps if s.registration.after == REGISTRATIONS_TIMED + 1]
    first_1023 = (
        sum(s.registration.seconds for s in steps[: steps.index(reached[0]) + 1])
        if reached
        else None
    )
    resolution = _resolution_figures(cold)
    checked = {
        **{f"tok_s_ratio_at_{n}": f["tok_s_ratio"] for n, f in per_n.items()},
        "first_1023_registrations_s": first_1023,
        "resolution_over_registered": resolution and resolution["over_registered"],
    }
    return {
        "ratio_to": steps[0].adapters if steps else None,
        "per_n": per_n,
        "registration": {
            "count": count,
            "seconds": seconds,
            "per_s": count / seconds if seconds > 0 and count else None,
            "failed": sum(r.failed for r in done),
            "first_1023_s": first_1023,
        },
        "resolution": resolution,
        "targets": harness.check("many_adapters", checked),
    }


def _resolution_figures(cold: dict | None) -> dict | None:
    resolved = (cold or {}).get("resolution")
    if resolved is None:
        return None
    return {
        "first_ttft_p50_s": resolved["cold_ttft_p50_s"],
        "registered_first_ttft_p50_s": cold["cold_ttft_p50_s"],
        "over_registered": ratio(resolved["cold_ttft_p50_s"], cold["cold_ttft_p50_s"]),
    }


def report(steps: list[Step], figures: dict, cold: dict, meta: dict) -> str:
    """A markdown table, a row per N, then the registration and cold-adapter lines."""
    s = meta["sizes"]
    lines = [
        f"Measured {meta['date']} on {harness.machine_line(meta['machine'])} (load average "
        f"{_load(meta.get('load_average_before'))} before, "
        f"{_load(meta.get('load_average_after'))} after) with `{meta['command']}`: the demo "
        f"model, 2 replicas, default engine settings; rank-{meta['adapter_spec']['rank']} "
        f"adapters on {'+'.join(meta['adapter_spec']['targets'])}; uniform traffic, "
        f"{s['concurrency']} concurrent, ~{s['prompt_tokens']} prompt + {s['max_tokens']} "
        f"output tokens, {s['requests']} requests per N after {s['warmup']} unmeasured.",
        "",
        f"| adapters | ok | out tok/s | vs {figures['ratio_to']} | TTFT p50 / p99 ms "
        "| TTFT p50 vs | registered (s, per s) | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    targets = figures["targets"]
    for step in steps:
        f, r = figures["per_n"][step.adapters], step.registration
        rate = f"{r.per_s:.1f}/s" if r.per_s else "-"
        target = targets.get(f"tok_s_ratio_at_{step.adapters}")
        vs = num(f["tok_s_ratio"], suffix="x")
        if target is not None:
            vs += f" ({target['target']}: {harness.met_word(target['met'])})"
        lines.append(
            f"| {step.adapters} | {f['ok']}/{f['requests']} | {f['output_tok_per_s']:.1f} "
            f"| {vs} | {ms(f['ttft_p50_s'], 0)} / "
            f"{ms(f['ttft_p99_s'], 0)} | {num(f['ttft_p50_ratio'], suffix='x')} "
            f"| {r.count} in {r.seconds:.1f} s, {rate} | {_load(step.load_average)} |"
        )
    reg = figures["registration"]
    lines.append("")
    if reg["count"]:
        line = (
            f"- registration through /v1/load_lora_adapter ({s['register_concurrency']} "
            f"in flight): {reg['count']} adapters in {reg['seconds']:.1f} s, "
            f"{reg['per_s']:.1f}/s"
        )
        if reg["first_1023_s"] is not None:
            t = targets["first_1023_registrations_s"]
            line += (
                f"; the first 1,023 in {reg['first_1023_s']:.1f} s (target {t['target']} s: "
                f"{harness.met_word(t['met'])})"
            )
        lines.append(line + (f"; {reg['failed']} FAILED" if reg["failed"] else ""))
    if cold["cold_ttft_p50_s"] is not None:
        lines.append(
            f"- a registered adapter no replica holds, one request at a time on an idle "
            f"server: TTFT p50 {ms(cold['cold_ttft_p50_s'], 0)} ms; the same adapter again "
            f"(resident) {ms(cold['warm_ttft_p50_s'], 0)} ms ({len(cold['cold_ttft_s'])} "
            "adapters)"
        )
    resolved = figures.get("resolution")
    if resolved is None or resolved["first_ttft_p50_s"] is None:
        lines.append(f"- first-request resolution: {meta['resolution']}")
    else:
        t = targets["resolution_over_registered"]
        lines.append(
            f"- first-request resolution (the 'local' resolver), the same probes to adapters "
            f"never registered: TTFT p50 {ms(resolved['first_ttft_p50_s'], 0)} ms, "
            f"{num(resolved['over_registered'], suffix='x')} that of a registered one "
            f"(target {t['target']}x: {harness.met_word(t['met'])})"
        )
    return "\n".join(lines)


def _load(avg: list[float] | None) -> str:
    return "-" if avg is None else " / ".join(f"{x:.2f}" for x in avg)


def _resolution_note() -> str:
    """How first-request resolution is measured, if it is."""
    if not resolvers_available():
        return "not measured: this build has no adapter resolvers"
    return (
        "the 'local' resolver over the adapters' directory; the cold-adapter probes sent "
        "to adapters never registered"
    )


def _meta(
    sizes: Sizes, spec: AdapterSpec, counts: tuple[int, ...], args: argparse.Namespace
) -> dict:
    return {
        **harness.run_meta(args),
        "counts": list(counts),
        "sizes": sizes.to_json(),
        "adapter_spec": asdict(spec),
        "resolution": _resolution_note(),
        "load_average_at_start": harness.loadavg(),
    }


def _json(steps: list[Step], figures: dict, cold: dict, meta: dict) -> dict:
    return {
        **meta,
        "figures": figures,
        "cold_adapter": cold,
        "steps": [
            {
                "adapters": s.adapters,
                "registration": {**asdict(s.registration), "per_s": s.registration.per_s},
                "summary": s.summary,
                "ttfts_s": s.load.ttfts_s,
                "load_average": s.load_average,
            }
            for s in steps
        ],
    }


def plot(steps: list[Step], path: Path, meta: dict) -> None:
    """Output tok/s, and TTFT p50 and p99, against the number of adapters (log scale)."""
    xs = [s.adapters for s in steps]
    alls = [s.summary["all"] for s in steps]
    fig, (tput, ttft) = harness.pyplot().subplots(1, 2, figsize=(10, 4))
    tput.plot(xs, [a["output_tok_per_s"] for a in alls], marker="o")
    tput.set(title="throughput", xlabel="distinct adapters (uniform traffic)",
             ylabel="output tok/s", ylim=(0, None))  # fmt: skip
    for q, style in (("p50", "-o"), ("p99", "--s")):
        ttft.plot(xs, [(a[f"ttft_{q}_s"] or 0) * 1000 for a in alls], style, label=q)
    ttft.set(title="TTFT", xlabel="distinct adapters (uniform traffic)", ylabel="ms",
             ylim=(0, None))  # fmt: skip
    ttft.legend()
    for ax in (tput, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    s = meta["sizes"]
    fig.suptitle(f"{meta['command']}: 2 replicas, {s['concurrency']} concurrent, "
                 f"{s['prompt_tokens']} in / {s['max_tokens']} out", fontsize=9)  # fmt: skip
    harness.save_plot(fig, path)


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
