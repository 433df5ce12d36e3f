"""A caller that gives up cancels its handle call, and Serve raises CancelledError in
LoRAReplica.generate wherever it waits: the request is aborted there and then, its KV
blocks and adapter slot reference freed, with no relay through the AdapterStore. Also
when the cancellation lands while the request is still being added to the engine."""

from __future__ import annotations

import asyncio

import pytest

from replica.wire import AdapterKey, GenerateRequest, Reply
from tests.replica.serve.replicas import LONG, replica


def test_a_cancelled_generation_is_aborted_and_frees_kv_and_its_slot(engine):
    r = replica(engine)
    request = GenerateRequest([5, 6, 7, 8], LONG, AdapterKey("adapter-00", 1), "req-1")
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


def test_a_cancellation_while_the_request_is_being_added_aborts_it(engine):
    """The add is queued for the engine thread and runs anyway: the abort queued behind
    it ends the request no one would read."""
    r = replica(engine)
    request = GenerateRequest([5, 6, 7], LONG, None, "req-2")

    async def main() -> dict:
        task = asyncio.ensure_future(anext(r.generate(request)))
        await asyncio.sleep(0)  # generate has queued the add and waits for a reply
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await r.aengine.call(engine.residency)  # after the add and the abort

    try:
        after = asyncio.run(main())
    finally:
        r.aengine.shutdown()
    assert after["aborted"] == 1 and after["num_running"] == after["num_waiting"] == 0
    assert after["kv_blocks_free"] == after["kv_blocks_total"]


class ReadyStream:
    """A RequestStream whose next replies arrive when `ready` is set."""

    def __init__(self) -> None:
        self.ready, self.finished = asyncio.Event(), False

    async def next(self) -> list[Reply]:
        await self.ready.wait()
        return [Reply((5,))]


class Recorder:
    """An AsyncLLMEngine that hands out one ReadyStream and records aborts."""

    def __init__(self) -> None:
        self.stream, self.aborted = ReadyStream(), []

    def add_request(self, request: GenerateRequest) -> ReadyStream:
        return self.stream

    def abort(self, stream: ReadyStream) -> None:
        self.aborted.append(stream)

    def shutdown(self) -> None:  # LoRAReplica.__del__
        pass


def test_a_cancellation_landing_with_a_reply_is_not_lost():
    """Replies arrive every step, so the caller's cancellation often lands as one does: it
    must still end the generation (asyncio.wait_for would return the reply instead, and
    the request would run to its end with no one reading)."""
    r = replica()
    r.aengine = Recorder()
    request = GenerateRequest([5, 6, 7], LONG, None, "req-3", timeout_s=60.0)

    async def main() -> None:
        task = asyncio.ensure_future(anext(r.generate(request)))
        await asyncio.sleep(0)  # generate waits for the first replies
        r.aengine.stream.ready.set()  # they arrive...
        task.cancel()  # ...as the caller cancels
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert r.aengine.aborted == [r.aengine.stream]
