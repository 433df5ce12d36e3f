"""The threaded engine: async token streams, abort, and errors surfaced to callers."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.errors import RequestError
from replica.serve.async_engine import AsyncLLMEngine
from replica.wire import SamplingParams


@pytest.fixture
def aengine(tiny):
    eng = LLMEngine(EngineConfig(model=str(tiny.model_dir), device="cpu", kv_cache_bytes=16 << 20))
    for name, path in tiny.adapters.items():
        eng.load_adapter(name, path)
    a = AsyncLLMEngine(eng)
    yield a
    a.shutdown()


async def collect(stream) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for ev in stream:
        tokens += ev.token_ids
        reason = ev.finish_reason
    return tokens, reason


def test_concurrent_streams_match_offline_generation(tiny, aengine):
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [([5, 6, 7, 8], None), ([9, 10, 11], "adapter-00"), ([12, 13], "adapter-03")]

    async def main():
        streams = [await aengine.add_request(p, sampling, a) for p, a in requests]
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)

    results = asyncio.run(main())
    ref = LLMEngine(EngineConfig(model=str(tiny.model_dir), device="cpu", num_slots=5))
    for name, path in tiny.adapters.items():
        ref.load_adapter(name, path)
    for (tokens, reason), (p, a) in zip(results, requests):
        assert reason == "length"
        assert tokens == ref.generate([(p, sampling, a)])[0].output_ids


def test_abort_ends_the_stream_and_frees_resources(aengine):
    async def main():
        stream = await aengine.add_request(
            [5, 6, 7], SamplingParams(temperature=0, max_tokens=200), "adapter-01"
        )
        first = await asyncio.wait_for(stream.__anext__(), 30)
        aengine.abort(stream.request_id)
        tokens, reason = await asyncio.wait_for(collect(stream), 30)
        return first, reason

    first, reason = asyncio.run(main())
    assert first.token_ids and reason == "abort"
    sched = aengine.engine.scheduler
    assert not sched.running and sched.allocator.num_free == sched.allocator.num_blocks
    assert all(s.refs == 0 for s in aengine.engine.adapters.pool.slots)


def test_refused_request_raises_in_the_caller(aengine):
    async def main():
        await aengine.add_request([5], SamplingParams(temperature=0), "no-such-adapter")

    with pytest.raises(RequestError, match="unknown adapter 'no-such-adapter'"):
        asyncio.run(main())
    assert aengine.is_alive()


class _StepRecorder:
    """An engine on cuda:1 whose step is a (fake) kernel launch; one step of work."""

    def __init__(self, cuda) -> None:
        self.device, self._cuda, self.stepped = torch.device("cuda", 1), cuda, threading.Event()

    def has_work(self) -> bool:
        return not self.stepped.is_set()

    def step(self) -> list:
        self._cuda.launch()
        self.stepped.set()
        return []

    def shutdown(self) -> None:
        pass


def test_the_loop_thread_steps_on_the_engine_device(fake_cuda):
    """Triton launches, graph capture and events go to the thread's current device: the
    loop thread starts on GPU 0, so it must make the engine's current first."""
    engine = _StepRecorder(fake_cuda)
    a = AsyncLLMEngine(engine)
    try:
        assert engine.stepped.wait(10)
    finally:
        a.shutdown()
    assert fake_cuda.launches == [1]
