"""The threaded engine: each request's replies as one list per step, abort, refusals and
failures raised in the caller, and the loop thread on the engine's device."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from replica.errors import RequestError, Unavailable
from replica.serve.async_engine import AsyncLLMEngine, RequestStream
from replica.wire import GenerateRequest, Reply, SamplingParams
from tests.engines import make_engine


@pytest.fixture
def aengine(tiny):
    eng = make_engine(tiny, num_slots=None)
    a = AsyncLLMEngine(eng)
    yield a
    a.shutdown()


async def messages(stream: RequestStream) -> list[list[Reply]]:
    out = []
    while (replies := await stream.next()) is not None:
        out.append(replies)
    return out


def test_concurrent_streams_match_offline_generation(tiny, aengine):
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [([5, 6, 7, 8], None), ([9, 10, 11], "adapter-00"), ([12, 13], "adapter-03")]

    async def main():
        streams = [aengine.add_request(GenerateRequest(p, sampling, a)) for p, a in requests]
        return await asyncio.wait_for(asyncio.gather(*(messages(s) for s in streams)), 60)

    results = asyncio.run(main())
    ref = make_engine(tiny, num_slots=5)
    for replies, (p, a) in zip(results, requests):
        flat = [r for message in replies for r in message]
        assert [r.finish_reason for r in flat] == [None] * 7 + ["length"]
        assert [t for r in flat for t in r.token_ids] == ref.generate([(p, sampling, a)])[
            0
        ].output_ids


def test_each_step_gives_one_reply_per_choice_and_the_stream_ends_after_the_last(aengine):
    """A slow reader gets the steps it missed at once, in order; nothing is merged."""
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=3)

    async def main():
        stream = aengine.add_request(GenerateRequest([5, 6, 7], sampling))
        # read nothing until the engine is done (commands run between steps, after each
        # step's replies were handed over)
        while await aengine.call(aengine.engine.has_work):
            pass
        return stream, await asyncio.wait_for(stream.next(), 30), await stream.next()

    stream, replies, end = asyncio.run(main())
    assert end is None and stream.finished
    assert len(replies) == 3 * 4 and all(len(r.token_ids) == 1 for r in replies)
    for step in range(4):  # the steps in order, each choice once per step
        assert sorted(r.index for r in replies[3 * step : 3 * step + 3]) == [0, 1, 2]
    assert [r.finished for r in replies] == [False] * 9 + [True] * 3


def test_abort_frees_the_requests_kv_and_slot(aengine):
    async def main():
        request = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_tokens=200),
                                  "adapter-01")  # fmt: skip
        stream = aengine.add_request(request)
        first = await asyncio.wait_for(stream.next(), 30)
        aengine.abort(stream)
        return first, await aengine.call(aengine.engine.residency)  # after the abort

    first, residency = asyncio.run(main())
    assert first[0].token_ids and residency["aborted"] == 1
    assert residency["num_running"] == residency["num_waiting"] == residency["slot_refs"] == 0
    assert residency["kv_blocks_free"] == residency["kv_blocks_total"]


def test_a_reader_whose_event_loop_closed_does_not_stop_the_engine_thread(aengine):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def leave() -> RequestStream:
        stream = aengine.add_request(GenerateRequest([5, 6, 7], long))
        await aengine.call(lambda: None)  # added; its replies now go to a closing loop
        return stream

    stream = asyncio.run(leave())

    async def later() -> dict:
        aengine.abort(stream)
        return await asyncio.wait_for(aengine.call(aengine.engine.residency), 30)

    assert asyncio.run(later())["num_running"] == 0 and aengine.is_alive()


def test_a_refused_request_raises_in_the_caller(aengine):
    async def main():
        stream = aengine.add_request(GenerateRequest([5], SamplingParams(), "no-such-adapter"))
        await stream.next()

    with pytest.raises(RequestError, match="unknown adapter 'no-such-adapter'"):
        asyncio.run(main())
    assert aengine.is_alive()


def test_a_duplicate_request_id_is_refused_and_the_first_request_goes_on(aengine):
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        first = aengine.add_request(GenerateRequest([5, 6], sampling, request_id="r"))
        second = aengine.add_request(GenerateRequest([7, 8], sampling, request_id="r"))
        with pytest.raises(RequestError, match="duplicate request id 'r'"):
            await second.next()
        aengine.abort(second)  # what the replica does with a stream that did not end well
        return await asyncio.wait_for(messages(first), 30)

    replies = [r for message in asyncio.run(main()) for r in message]
    assert [t for r in replies for t in r.token_ids] and replies[-1].finish_reason == "length"


def test_a_failed_step_ends_every_request_with_unavailable(aengine, monkeypatch):
    def broken() -> None:
        raise RuntimeError("device on fire")

    async def main():
        monkeypatch.setattr(aengine.engine, "step", broken)
        stream = aengine.add_request(GenerateRequest([5, 6], SamplingParams(max_tokens=4)))
        await asyncio.wait_for(stream.next(), 30)

    with pytest.raises(Unavailable, match="generation failed: engine step failed: device on fire"):
        asyncio.run(main())
    assert not aengine._streams  # nothing left to deliver to


class _StepRecorder:
    """An engine on cuda:1 whose step is a (fake) kernel launch; one step of work."""

    def __init__(self, cuda) -> None:
        self.device, self._cuda, self.stepped = torch.device("cuda", 1), cuda, threading.Event()

    def has_work(self) -> bool:
        return not self.stepped.is_set()

    def step(self) -> dict:
        self._cuda.launch()
        self.stepped.set()
        return {}  # no request had news

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


def test_a_grammar_the_vocabulary_cannot_write_is_the_callers_error_not_a_503():
    """The trained demo's word-level vocabulary has no token that starts the JSON string
    "zebra": the request ends with a RequestError (a 400 at the ingress: retrying cannot
    help), not Unavailable, and nothing is left behind."""
    from cluster.demo import training as dt
    from replica.wire import StructuredOutput

    eng = make_engine(dt.demo_assets().model_dir, num_slots=None)
    aengine = AsyncLLMEngine(eng)
    schema = StructuredOutput(kind="json_schema", json_schema='{"enum": ["zebra"]}')
    sampling = SamplingParams(max_tokens=8, structured_output=schema)

    async def main():
        stream = aengine.add_request(GenerateRequest([5, 6, 7], sampling))
        return await asyncio.wait_for(messages(stream), 30)

    try:
        with pytest.raises(RequestError, match="no token of the model's vocabulary can continue"):
            asyncio.run(main())
        assert not aengine._streams
        assert asyncio.run(aengine.call(lambda: eng.scheduler.allocator.num_free)) == (
            eng.scheduler.allocator.num_blocks
        )
    finally:
        aengine.shutdown()
