"""Soak: a steady request rate with adapter churn (runtime loads and unloads while traffic
flows) for a bounded time. No request fails, nothing leaks (KV blocks, slot references),
and the replicas' memory stays flat.

    LORAFLEET_SOAK_S=600 pytest tests/reliability/test_soak.py    # ten minutes instead of ~20 s
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from tests.reliability.conftest import ADMIN, PRELOADED, replica_stats, wait_idle

pytestmark = pytest.mark.serve

SOAK_S = float(os.environ.get("LORAFLEET_SOAK_S", "20"))
RATE = 6.0  # requests per second, Poisson arrivals
CHURNED = ["adapter-04", "adapter-05", "adapter-06", "adapter-07"]  # loaded and unloaded
RSS_GROWTH_LIMIT = 64 * 2**20  # per replica, between the warm-up and the end


async def _traffic(url: str, assets, until: float, rng: random.Random) -> dict[str, int]:
    """Poisson arrivals over the preloaded adapters and the base; a churner loads and
    unloads the others, and requests only name an adapter while it is loaded."""
    outcomes: dict[str, int] = {}
    loaded: set[str] = set()
    pending: set[asyncio.Task] = set()

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(model: str) -> None:
            body = {"model": model, "prompt": "soak " * rng.randint(1, 40)}
            body |= {"max_tokens": rng.randint(1, 24), "stream": rng.random() < 0.5}
            r = await client.post("/v1/completions", json=body)
            text = r.text
            ok = r.status_code == 200 and '"error"' not in text
            key = "ok" if ok else f"{r.status_code}:{text[:120]}"
            outcomes[key] = outcomes.get(key, 0) + 1

        async def churn() -> None:
            while time.monotonic() < until:
                name = rng.choice(CHURNED)
                if name in loaded:
                    loaded.discard(name)  # no new requests before the unload
                    await asyncio.sleep(1.0)  # let requests already sent arrive
                    r = await client.post(
                        "/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN
                    )
                else:
                    path = str(assets.adapters[name])
                    r = await client.post(
                        "/v1/load_lora_adapter",
                        json={"lora_name": name, "lora_path": path},
                        headers=ADMIN,
                    )
                    if r.status_code == 200:
                        loaded.add(name)
                key = f"churn:{r.status_code}"
                outcomes[key] = outcomes.get(key, 0) + 1
                await asyncio.sleep(rng.uniform(0.5, 1.5))

        churner = asyncio.create_task(churn())
        while time.monotonic() < until:
            model = rng.choice(["tiny-base", *PRELOADED, *sorted(loaded)])
            task = asyncio.create_task(one(model))
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(rng.expovariate(RATE))
        await churner
        await asyncio.gather(*pending)
        for name in sorted(loaded):  # leave the app as it was
            await client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN)
    return outcomes


def _rss(cluster) -> dict[str, int]:
    return {rid: s["rss_bytes"] for rid, s in wait_idle(cluster).items()}


def test_soak_with_adapter_churn_loses_nothing_and_leaks_nothing(cluster, assets):
    rng = random.Random(0)
    warmup = time.monotonic() + min(10.0, SOAK_S / 3)
    asyncio.run(_traffic(cluster["url"], assets, warmup, rng))  # allocator pools fill up
    before = _rss(cluster)
    outcomes = asyncio.run(_traffic(cluster["url"], assets, time.monotonic() + SOAK_S, rng))
    after = _rss(cluster)
    failures = {k: v for k, v in outcomes.items() if k not in ("ok", "churn:200")}
    assert not failures, outcomes
    assert outcomes["ok"] >= RATE * SOAK_S / 2, outcomes
    assert outcomes.get("churn:200", 0) >= 4, outcomes
    for rid, rss in after.items():
        if rid in before and before[rid]:
            assert rss - before[rid] < RSS_GROWTH_LIMIT, (rid, before[rid], rss)
    assert len(replica_stats(cluster)) >= 2
