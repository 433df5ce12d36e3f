"""`python -m benchmarks overhead`: what serving over HTTP costs against the engine in-process.

One workload, run twice on the same CPUs: by the engine in this process (torch given all
`--num-cpus` threads; requests kept `--concurrency` deep, as `bench engine` drives it),
and through the demo application on a local Ray of `--num-cpus` CPUs with `--replicas`
replicas of one CPU each (Ingress, router, Serve handles, SSE), by a client keeping
`--concurrency` streamed completions in flight. Both get the same token-id prompts, the
same adapters and greedy outputs of `--output-len` tokens. The figure is the ratio of
output tok/s, HTTP over engine (its target: benchmarks/targets.toml [overhead]).

    python -m benchmarks overhead             # ~2 minutes on 2 CPU cores
    python -m benchmarks overhead --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from benchmarks import harness
from benchmarks.engine import Workload, run_workload
from benchmarks.harness import Sizes
from cluster import serving
from cluster.bench.http import RequestRecord, stream_completion
from cluster.demo.assets import DemoSpec, cached_demo_assets
from replica.config import EngineConfig

FULL = Sizes(adapters=8, requests=96, warmup=16, concurrency=16, prompt_tokens=128,
             max_tokens=32, replicas=2, kv_cache_bytes=256 * 2**20)  # fmt: skip
QUICK = Sizes(adapters=2, requests=8, warmup=2, concurrency=4, prompt_tokens=16, max_tokens=4,
              kv_cache_bytes=16 * 2**20)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="A smoke run of both arms (CI).")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of both arms (default: this machine's).")  # fmt: skip
    p.add_argument("--replicas", type=int, default=None, help="Replicas of the HTTP arm (2).")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one).")
    p.add_argument("--json", type=Path, default=None, help="Write every figure here.")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    if args.replicas is not None:
        sizes = replace(sizes, replicas=args.replicas)
    cpus = args.num_cpus or harness.num_cpus()
    figures = measure(sizes, cpus, args.port or harness.free_port(), args.seed)
    checked = harness.check("overhead", figures)
    print(
        f"overhead bench: {sizes.requests} requests x {sizes.prompt_tokens}+{sizes.max_tokens} "
        f"tokens, {sizes.concurrency} concurrent, {sizes.adapters} adapters, {cpus} CPUs\n"
        f"  engine in-process   {figures['engine_tok_per_s']:8.1f} output tok/s\n"
        f"  HTTP, {sizes.replicas} replica(s)  {figures['http_tok_per_s']:8.1f} output tok/s\n"
        + "\n".join(f"  {line}" for line in harness.verdict_lines(checked))
    )
    report = {**harness.run_meta(args), "sizes": sizes.to_json(), "num_cpus": cpus,
              **figures, "targets": checked}  # fmt: skip
    harness.write_json(args.json, report)
    return 0


def measure(sizes: Sizes, cpus: int, port: int, seed: int = 0) -> dict:
    """Both arms on one workload; their output tok/s and the ratio."""
    assets = cached_demo_assets(DemoSpec(num_adapters=sizes.adapters))
    names = list(assets.adapters)
    rng = random.Random(seed)
    vocab = DemoSpec().vocab_size
    total = sizes.warmup + sizes.requests
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)] for _ in range(total)]
    adapters = [names[i % len(names)] for i in range(total)]
    engine = _engine_tok_per_s(sizes, cpus, assets, prompts, adapters)
    http = _http_tok_per_s(sizes, cpus, port, prompts, adapters)
    return {"engine_tok_per_s": engine, "http_tok_per_s": http, "http_over_engine": http / engine}


def _engine_tok_per_s(sizes: Sizes, cpus: int, assets, prompts, adapters) -> float:
    w = sizes.warmup
    config = EngineConfig(
        model=str(assets.model_dir), device="cpu", max_num_seqs=sizes.concurrency,
        kv_cache_bytes=sizes.kv_cache_bytes,
        adapters={"num_slots": sizes.adapters + 1, "max_loras_per_batch": sizes.adapters},
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(cpus)
    try:
        warm = Workload("warmup", prompts[:w], adapters[:w], sizes.max_tokens, sizes.concurrency)
        run_workload(config, assets, warm)  # first-run costs (allocator, kernels) out of the figure
        measured = Workload(
            "measured", prompts[w:], adapters[w:], sizes.max_tokens, sizes.concurrency
        )
        return run_workload(config, assets, measured).tok_per_s
    finally:
        torch.set_num_threads(threads)


def _http_tok_per_s(sizes: Sizes, cpus: int, port: int, prompts, adapters) -> float:
    sizes = replace(sizes, slots=sizes.adapters + 1)
    config = harness.demo_serve_config(
        sizes, port, settings=[f"engine.adapters.max_loras_per_batch={sizes.adapters}"]
    )
    with harness.local_ray(cpus):
        serving.deploy(config)
        url = f"http://127.0.0.1:{port}"
        w = sizes.warmup
        asyncio.run(_drive(url, prompts[:w], adapters[:w], sizes))
        return asyncio.run(_drive(url, prompts[w:], adapters[w:], sizes))


async def _drive(url: str, prompts, adapters, sizes: Sizes) -> float:
    """Output tok/s of the requests streamed `concurrency` at a time; raises on a failure."""
    slots = asyncio.Semaphore(sizes.concurrency)
    records = [RequestRecord(i, a, False) for i, a in enumerate(adapters)]

    async def one(client: httpx.AsyncClient, prompt: list[int], record: RequestRecord) -> None:
        body = {"model": record.model, "prompt": prompt, "max_tokens": sizes.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with slots:
            try:
                await stream_completion(client, f"{url}/v1/completions", body, record)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                record.error = f"{type(e).__name__}: {e}"

    async with httpx.AsyncClient(timeout=300.0) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p, r) for p, r in zip(prompts, records)))
        wall = time.perf_counter() - start
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    return sum(r.output_tokens for r in records) / wall


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
