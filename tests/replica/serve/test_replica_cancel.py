"""A caller that gives up cancels its handle call, and Serve raises CancelledError in
LoRAReplica.generate wherever it waits: the request is aborted there and then, its KV
blocks and adapter slot reference freed, with no relay through the AdapterStore. Also
when the cancellation lands while the request is still being added to the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.serve.async_engine import AsyncLLMEngine
from replica.serve.deployment import LoRAReplica
from replica.wire import AdapterKey, GenerateRequest, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


def replica(engine: LLMEngine | None = None) -> Any:
    r = LoRAReplica.func_or_class.__new__(LoRAReplica.func_or_class)
    if engine is not None:
        r.engine, r.aengine, r.source = engine, AsyncLLMEngine(engine), engine.adapters.source
    return r


@pytest.fixture
def engine(tiny):
    config = EngineConfig(model=str(tiny.model_dir), device="cpu", kv_cache_bytes=16 << 20)
    eng = LLMEngine(config)
    key = str(AdapterKey("adapter-00", 1))  # the name the replica gives a version
    eng.load_adapter(key, tiny.adapters["adapter-00"])
    return eng


def test_a_cancelled_generation_is_aborted_and_frees_kv_and_its_slot(engine):
    r = replica(engine)
    request = GenerateRequest(AdapterKey("adapter-00", 1), [5, 6, 7, 8], LONG, "req-1")
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in r.generate(request):
            started.set()

    async def main() -> dict:
        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 60)
        snapshot = await r.aengine.call(engine.residency)
        assert snapshot["num_running"] == 1 and snapshot["slot_refs"] == 1
        task.cancel()  # what Serve does to the replica's handler when the caller cancels
        with pytest.raises(asyncio.CancelledError):
            await task
        return await r.aengine.call(engine.residency)  # runs after the queued abort

    try:
        after = asyncio.run(main())
    finally:
        r.aengine.shutdown()
    assert after["aborted"] == 1 and after["num_running"] == after["num_waiting"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["slot_refs"] == 0


class SlowAdd:
    """An AsyncLLMEngine whose add_request waits for `added` (the engine thread busy)."""

    def __init__(self) -> None:
        self.adding, self.added, self.aborted = asyncio.Event(), asyncio.Event(), []

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        self.adding.set()
        await self.added.wait()
        raise AssertionError("never reached: the caller cancels first")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:  # LoRAReplica.__del__
        pass


def test_a_cancellation_while_the_request_is_being_added_aborts_it():
    """The add is queued for the engine thread and runs anyway: the abort queued behind
    it ends the request no one would read."""
    r = replica()
    r.aengine = SlowAdd()
    request = GenerateRequest(None, [5, 6, 7], LONG, "req-2")

    async def main() -> None:
        task = asyncio.ensure_future(anext(r.generate(request)))
        await r.aengine.adding.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert r.aengine.aborted == ["req-2"]
