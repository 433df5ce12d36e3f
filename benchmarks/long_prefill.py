"""Long-prompt prefill: lorafleet's engine against transformers' sdpa forward, same prompt.

    python -m benchmarks long-prefill [--tokens 8192] [--repeats 3] [--json PATH]

The demo model (cluster.demo.assets.DemoSpec(): hidden 512, 8 layers, GQA 8/2, fp32) with
max_position_embeddings raised to hold the prompt (the weights are the same: they are
seeded by name), on the CPU. Each measurement runs in its own process, so its peak
resident set (getrusage ru_maxrss, which torch's CPU allocations count towards, unlike
tracemalloc) is that run's alone. A process loads its model, warms it up on a short
prompt, records its resident set, then times one prefill of the long prompt:

- `hf`: transformers' model (attn_implementation="sdpa") over the prompt, KV cache on,
  logits of the last position only (logits_to_keep=1, what a sampler needs);
- `ours_chunked`: LLMEngine.generate of one greedy token, chunked prefill at the
  engine's default step budget (max_num_batched_tokens 2048: later chunks attend to the
  cache);
- `ours_whole`: the same with the whole prompt in one step.

Our engine runs with num_slots=2 (one adapter slot beside the base): the adapter arenas
(1 GiB by default on the CPU) are LoRA serving's fixed cost, not the prefill's, and
transformers' model holds none.

Runs alternate (hf, ours_chunked, ours_whole, hf, ...) so a shared machine's drift hits
each alike. Printed and written: each run's time, peak and loaded resident set, and per
variant the median and range of the time, its ratio to hf's median time and to hf's run
of the same repeat (paired), the same for CPU time (user + system, all threads), and its
median peak beside hf's plus the KV bytes (ours: the engine's cache, sized to the prompt,
held from load on; hf: its DynamicCache, grown during the run). Each run records the
1-minute load average when it ends.

The children inherit the environment, OpenMP's included (recorded as `omp_env`). On a
CPU shared with other jobs it matters: libgomp, unless told otherwise, spins at every
parallel region's barrier (each large elementwise op, GEMM or attention call is one)
while its partner thread waits for a core, so a run's CPU time grows with its number of
ops, not only its work: four 2048-token steps pay it four times where one 8k step pays
it once. `OMP_WAIT_POLICY=passive python -m benchmarks.long_prefill ...` makes waiting
threads sleep instead (`OMP_NUM_THREADS=1` runs one thread), for every variant alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from benchmarks import harness

VARIANTS = ("hf", "ours_chunked", "ours_whole")
RESULTS = Path(__file__).resolve().parent / "results" / "long_prefill.json"
CHUNK = 2048  # EngineConfig's default max_num_batched_tokens
BLOCK = 16
WARMUP_TOKENS = 64
GB = 1e9


def _spec(tokens: int):
    from cluster.demo.assets import DemoSpec

    return replace(DemoSpec(), max_position_embeddings=max(2048, 2 * tokens))


def _prompt(tokens: int, vocab: int) -> list[int]:
    """Deterministic ids past the specials (0-2): the same prompt in every process."""
    return [3 + (i * 7919) % (vocab - 3) for i in range(tokens)]


def _kv_bytes(spec, tokens: int) -> int:
    """K and V of `tokens` positions over every layer, fp32."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * tokens * 4


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hf_prefill(model_dir: Path) -> Callable[[list[int]], None]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()

    def forward(ids: list[int]) -> None:
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    return forward


def _our_prefill(model_dir: Path, spec, tokens: int, step_tokens: int):
    from replica.config import EngineConfig
    from replica.engine.engine import LLMEngine
    from replica.wire import SamplingParams

    blocks = -(-(tokens + 1) // BLOCK) + 1  # the prompt and its sampled token, + scratch
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cpu", dtype="float32",
            kv_cache_bytes=blocks * BLOCK * _kv_bytes(spec, 1), block_size=BLOCK,
            max_num_batched_tokens=step_tokens, max_model_len=tokens + BLOCK,
            enable_prefix_caching=False, adapters={"num_slots": 2},
        )
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def generate(ids: list[int]) -> None:
        engine.generate([(ids, greedy, None)])

    return generate


def child(variant: str, tokens: int) -> dict:
    """One measurement in this process: the long prefill's seconds, the peak resident set
    and the resident set just before it (model loaded and warmed up)."""
    from cluster.demo.assets import cached_demo_assets

    spec = _spec(tokens)
    model_dir = cached_demo_assets(spec).model_dir
    if variant == "hf":
        prefill = _hf_prefill(model_dir)
    else:
        step = tokens if variant == "ours_whole" else CHUNK
        prefill = _our_prefill(model_dir, spec, tokens, step)
    prompt = _prompt(tokens, spec.vocab_size)
    prefill(prompt[:WARMUP_TOKENS])
    loaded = _rss()
    cpu, start = _cpu_seconds(), time.perf_counter()
    prefill(prompt)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "variant": variant, "seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak,
        "loaded_rss": loaded, "load_average": os.getloadavg()[0],
    }  # fmt: skip


def _cpu_seconds() -> float:
    """User + system CPU time of this process, every thread: on a shared machine it
    drifts less than wall time (time spent waiting for a core is not counted)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spawn(variant: str, tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.long_prefill", "--child", variant, "--tokens",
         str(tokens)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], tokens: int) -> dict:
    """Per variant: median and range of seconds and peaks, ratios to hf's medians."""
    kv = _kv_bytes(_spec(tokens), tokens)
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    keys = ("seconds", "cpu_seconds", "peak_rss", "loaded_rss")
    med = {v: {k: statistics.median(r[k] for r in rs) for k in keys} for v, rs in by.items() if rs}
    out = {}
    for v, rs in by.items():
        if not rs:
            continue
        secs = [r["seconds"] for r in rs]
        out[v] = {
            **med[v],
            "seconds_min": min(secs),
            "seconds_max": max(secs),
            "time_over_hf": med[v]["seconds"] / med["hf"]["seconds"],
            "time_over_hf_paired": [  # each repeat against hf's run of the same repeat
                r["seconds"] / h["seconds"] for r, h in zip(rs, by["hf"])
            ],
            "cpu_over_hf": med[v]["cpu_seconds"] / med["hf"]["cpu_seconds"],
            "cpu_over_hf_paired": [
                r["cpu_seconds"] / h["cpu_seconds"] for r, h in zip(rs, by["hf"])
            ],
            "peak_over_hf_bytes": med[v]["peak_rss"] - med["hf"]["peak_rss"],
            "peak_growth_bytes": med[v]["peak_rss"] - med[v]["loaded_rss"],
        }
    return {"kv_bytes": kv, "variants": out}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child(args.child, args.tokens)))
        return 0
    if "hf" not in args.variants:
        args.variants.insert(0, "hf")  # every ratio is to hf
    from cluster.demo.assets import cached_demo_assets

    cached_demo_assets(_spec(args.tokens))  # built once, before any timed process
    runs = []
    for rep in range(args.repeats):
        for variant in args.variants:
            r = _spawn(variant, args.tokens)
            runs.append(r | {"repeat": rep})
            print(
                f"run {rep} {variant:13s} {r['seconds']:7.2f} s (cpu {r['cpu_seconds']:6.1f} s)"
                f"  peak {r['peak_rss'] / GB:5.2f} GB"
                f"  loaded {r['loaded_rss'] / GB:5.2f} GB  load {r['load_average']:.1f}",
                flush=True,
            )
    summary = summarize(runs, args.tokens)
    kv = summary["kv_bytes"]
    print(f"KV of the prompt: {kv / GB:.3f} GB")
    for v, s in summary["variants"].items():
        print(
            f"{v:13s} median {s['seconds']:7.2f} s ({s['seconds_min']:.2f}-{s['seconds_max']:.2f})"
            f"  x{s['time_over_hf']:.2f} hf (paired "
            f"{', '.join(f'{x:.2f}' for x in s['time_over_hf_paired'])})"
            f"  peak {s['peak_rss'] / GB:.2f} GB ({s['peak_over_hf_bytes'] / GB:+.2f} GB vs hf)"
            f"\n{'':13s} cpu x{s['cpu_over_hf']:.2f} hf (paired "
            f"{', '.join(f'{x:.2f}' for x in s['cpu_over_hf_paired'])})"
        )
    report = {
        "benchmark": "long_prefill",
        "tokens": args.tokens,
        "model": "DemoSpec() (hidden 512, 8 layers, 8/2 heads, fp32), max_position_embeddings "
        f"{_spec(args.tokens).max_position_embeddings}",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": __import__("torch").__version__,
            "transformers": __import__("transformers").__version__,
            "torch_threads": __import__("torch").get_num_threads(),
            # libgomp's wait at a parallel region's barrier: unset spins (see the module
            # docstring)
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
        },
        "date": time.strftime("%Y-%m-%d"),
        "memory": "peak resident set per process (getrusage ru_maxrss); loaded_rss is "
        "/proc/self/statm just before the timed prefill",
        "runs": runs,
        **summary,
    }
    harness.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
