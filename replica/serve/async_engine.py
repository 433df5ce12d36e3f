"""The engine's step loop on its own thread, with an asyncio face.

Callers never touch the engine directly: every call becomes a command that
the loop thread runs between steps, so the engine stays single-threaded and
no caller ever blocks a step. Tokens come back as an async stream per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from replica.device import use_device
from replica.engine.engine import LLMEngine, StepOutput
from replica.engine.sequence import Sequence
from replica.wire import Reply, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """Async iterator over one request's Replies: a token each, of any of its n choices
    (Reply.index), each choice's last one finished. It ends when every choice has."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, n: int = 1) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._open = set(range(n))  # choices not finished yet

    def _push(self, event: Reply) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Reply:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._seen(event)
        return event

    async def next_batch(self) -> list[Reply] | None:
        """Every reply available now (waiting for at least one), merged per choice: one
        Reply per choice with news, by index. None once every choice has finished. Lets a
        consumer that crosses a process boundary send one message per batch."""
        if self.finished:
            return None
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        by_choice: dict[int, list[Reply]] = {}
        for event in events:
            self._seen(event)
            by_choice.setdefault(event.index, []).append(event)
        return [Reply.merge(by_choice[i]) for i in sorted(by_choice)]

    @property
    def finished(self) -> bool:
        return not self._open

    def _seen(self, event: Reply) -> None:
        if event.finished:
            self._open.discard(event.index)


@dataclass
class _Entry:
    """A request in flight on the loop thread: its choice 0, its stream, the choices whose
    last reply is still to be sent."""

    seq: Sequence
    stream: RequestStream
    open: set[int]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Entry] = {}
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- API (any thread / event loop) ---------------------------------------------------------

    async def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
        *,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; raises RequestError at once if the engine refuses it. Tenant,
        weight and salt as LLMEngine.add_request takes them."""
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(rid, asyncio.get_running_loop(), sampling.n)

        def add() -> None:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid!r}")
            seq = self.engine.add_request(
                prompt_ids, sampling, adapter, rid,
                tenant=tenant, tenant_weight=tenant_weight, cache_salt=cache_salt,
            )  # fmt: skip
            self._streams[rid] = _Entry(seq, stream, set(range(sampling.n)))

        await self.call(add)
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now (client gone): frees its KV blocks and slot reference."""
        self._submit(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # handed to the caller, not the loop
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(run)
        return await future

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self.engine.shutdown()

    # -- the loop thread ----------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        use_device(self.engine.device)  # this thread's launches, events and graphs
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_work():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step must not hang every caller
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {e}")
                continue
            self._deliver(outputs)
        self._fail_all("engine shut down")

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.seq.request_id)
            if entry is not None:
                self._send(entry, out)

    def _send(self, entry: _Entry, out: StepOutput) -> None:
        entry.stream._push(_event(out))
        if out.finished:
            entry.open.discard(out.seq.index)
            if not entry.open:
                del self._streams[entry.seq.request_id]

    def _abort(self, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            for out in self.engine.abort(entry.seq):
                self._send(entry, out)

    def _fail_all(self, message: str) -> None:
        for entry in list(self._streams.values()):
            entry.seq.error = message
            for out in self.engine.abort(entry.seq, "error"):
                self._send(entry, out)
        self._streams.clear()


def _event(out: StepOutput) -> Reply:
    seq, finished = out.seq, out.finished
    error = seq.error if finished else None
    return Reply(
        token_ids=() if out.new_token is None else (out.new_token,),
        finished=finished,
        finish_reason=seq.finish_reason if finished else None,
        error=error,
        status=500 if error else None,
        num_prompt_tokens=len(seq.prompt_ids),
        num_cached_tokens=seq.num_cached_tokens or 0,
        index=seq.index,
        logprobs=() if out.logprobs is None else (out.logprobs,),
        prompt_logprobs=out.prompt_logprobs,
        stop_token=seq.stop_token if finished else None,
    )


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
