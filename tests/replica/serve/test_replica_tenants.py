"""LoRAReplica hands a GenerateRequest's tenant, weight and cache_salt to its engine: the
same prompt from another tenant or salt is no prefix-cache hit, from the same one it is;
the engine's fair-share counters are named by tenant in its residency snapshot."""

from __future__ import annotations

import asyncio
from typing import Any

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.serve.async_engine import AsyncLLMEngine
from replica.serve.deployment import LoRAReplica
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import tokens

PROMPT = tokens(3, 33)  # eight full blocks of 4


def replica(tiny) -> Any:
    config = EngineConfig(model=str(tiny.model_dir), device="cpu", kv_cache_bytes=16 << 20,
                          block_size=4, scheduling="vtc")  # fmt: skip
    r = LoRAReplica.__new__(LoRAReplica)
    r.engine = LLMEngine(config)
    r.aengine = AsyncLLMEngine(r.engine)
    return r


def test_the_tenant_and_salt_reach_the_engine(tiny):
    r = replica(tiny)
    sampling = SamplingParams(temperature=0, max_tokens=2)

    async def cached(i: int, tenant: str | None, salt: str | None = None) -> int:
        request = GenerateRequest(PROMPT, sampling, None, f"r{i}", tenant=tenant,
                                  tenant_weight=2.0, cache_salt=salt)  # fmt: skip
        messages = [replies async for replies in r.generate(request)]
        return messages[-1][-1].num_cached_tokens

    async def main() -> list[int]:
        calls = [("a", None), ("b", None), ("a", None), ("a", "s"), ("a", "s"), (None, None)]
        return [await cached(i, t, s) for i, (t, s) in enumerate(calls)]

    try:
        assert asyncio.run(asyncio.wait_for(main(), 60)) == [0, 0, 32, 0, 32, 0]
        counters = r.engine.residency()["tenant_counters"]
        assert set(counters) == {"a", "b", ""}  # "": requests without a tenant
    finally:
        r.aengine.shutdown()
