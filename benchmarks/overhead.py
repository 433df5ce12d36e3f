"""`lorafleet bench overhead`: what serving over HTTP costs against the engine in-process.

One workload, run twice on the same CPUs: by the engine in this process (torch given all
`--num-cpus` threads; requests kept `--concurrency` deep, as `bench engine` drives it),
and through the demo application on a local Ray of `--num-cpus` CPUs with `--replicas`
replicas of one CPU each (Ingress, router, Serve handles, SSE), by a client keeping
`--concurrency` streamed completions in flight. Both get the same token-id prompts, the
same adapters and greedy outputs of `--output-len` tokens. The figure is the ratio of
output tok/s, HTTP over engine (issue 18's CPU target: >= 0.9 with 2 replicas).

    lorafleet bench overhead                  # ~2 minutes on 2 CPU cores
    lorafleet bench overhead --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from cluster import serving
from cluster.bench.engine import Workload, _run
from cluster.bench.http import RequestRecord, _stream
from cluster.bench.stats import machine, num_cpus
from cluster.bench.suite import demo_serve_config, start_ray, stop_ray
from cluster.demo.assets import DemoSpec, cached_demo_assets
from replica.config import EngineConfig

TARGET = 0.9  # HTTP output tok/s >= 0.9x the engine's


@dataclass(frozen=True)
class Sizes:
    adapters: int = 8
    requests: int = 96
    warmup: int = 16  # sent first in both arms, not measured
    concurrency: int = 16
    prompt_len: int = 128
    output_len: int = 32
    replicas: int = 2
    kv_cache_bytes: int = 256 * 2**20  # per replica, and the engine's


QUICK = Sizes(adapters=2, requests=8, warmup=2, concurrency=4, prompt_len=16, output_len=4,
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
    sizes = QUICK if args.quick else Sizes()
    if args.replicas is not None:
        sizes = Sizes(**{**sizes.__dict__, "replicas": args.replicas})
    cpus = args.num_cpus or num_cpus()
    report = measure(sizes, cpus, args.port or _free_port(), args.seed)
    print(
        f"overhead bench: {sizes.requests} requests x {sizes.prompt_len}+{sizes.output_len} "
        f"tokens, {sizes.concurrency} concurrent, {sizes.adapters} adapters, {cpus} CPUs\n"
        f"  engine in-process   {report['engine_tok_per_s']:8.1f} output tok/s\n"
        f"  HTTP, {sizes.replicas} replica(s)  {report['http_tok_per_s']:8.1f} output tok/s\n"
        f"  http_over_engine    {report['http_over_engine']:8.3f} (target >= {TARGET})"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def measure(sizes: Sizes, cpus: int, port: int, seed: int = 0) -> dict:
    """Both arms on one workload; their output tok/s and the ratio."""
    assets = cached_demo_assets(DemoSpec(num_adapters=sizes.adapters))
    names = list(assets.adapters)
    rng = random.Random(seed)
    vocab = DemoSpec().vocab_size
    total = sizes.warmup + sizes.requests
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes.prompt_len)] for _ in range(total)]
    adapters = [names[i % len(names)] for i in range(total)]
    engine = _engine_tok_per_s(sizes, cpus, assets, prompts, adapters)
    http = _http_tok_per_s(sizes, cpus, port, prompts, adapters)
    return {
        "machine": machine(),
        "sizes": sizes.__dict__,
        "num_cpus": cpus,
        "engine_tok_per_s": engine,
        "http_tok_per_s": http,
        "http_over_engine": http / engine,
        "target": TARGET,
    }


def _engine_tok_per_s(sizes: Sizes, cpus: int, assets, prompts, adapters) -> float:
    w = sizes.warmup
    config = EngineConfig(
        model=str(assets.model_dir), device="cpu", num_slots=sizes.adapters + 1,
        max_loras_per_batch=sizes.adapters, max_num_seqs=sizes.concurrency,
        kv_cache_bytes=sizes.kv_cache_bytes,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(cpus)
    try:
        warm = Workload("warmup", prompts[:w], adapters[:w], sizes.output_len, sizes.concurrency)
        _run(config, assets, warm)  # first-run costs (allocator, kernels) out of the figure
        measured = Workload(
            "measured", prompts[w:], adapters[w:], sizes.output_len, sizes.concurrency
        )
        return _run(config, assets, measured).tok_per_s
    finally:
        torch.set_num_threads(threads)


def _http_tok_per_s(sizes: Sizes, cpus: int, port: int, prompts, adapters) -> float:
    config = demo_serve_config(
        replicas=sizes.replicas,
        adapters=sizes.adapters,
        slots=sizes.adapters + 1,
        kv_cache_bytes=sizes.kv_cache_bytes,
        port=port,
        settings=[f"engine.max_loras_per_batch={sizes.adapters}"],
    )
    start_ray(cpus)
    try:
        serving.deploy(config)
        url = f"http://127.0.0.1:{port}"
        w = sizes.warmup
        asyncio.run(_drive(url, prompts[:w], adapters[:w], sizes))
        return asyncio.run(_drive(url, prompts[w:], adapters[w:], sizes))
    finally:
        stop_ray()


async def _drive(url: str, prompts, adapters, sizes: Sizes) -> float:
    """Output tok/s of the requests streamed `concurrency` at a time; raises on a failure."""
    slots = asyncio.Semaphore(sizes.concurrency)
    records = [RequestRecord(i, a, False) for i, a in enumerate(adapters)]

    async def one(client: httpx.AsyncClient, prompt: list[int], record: RequestRecord) -> None:
        body = {"model": record.model, "prompt": prompt, "max_tokens": sizes.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with slots:
            try:
                await _stream(client, f"{url}/v1/completions", body, record)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
