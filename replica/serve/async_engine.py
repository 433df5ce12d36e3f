"""The engine's step loop on its own thread, with an asyncio face.

Callers never touch the engine directly: every call becomes a command that
the loop thread runs between steps, so the engine stays single-threaded and
no caller ever blocks a step. Each request's replies come back on a RequestStream: the
list the engine made for it each step, then the end (when its SequenceGroup has
finished: the one place that tells), or the exception that ended it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from replica.device import use_device
from replica.engine.engine import LLMEngine, StepReplies
from replica.engine.sequence import SequenceGroup
from replica.errors import RequestError, RequestRefused, Unavailable
from replica.wire import GenerateRequest, Reply

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """One request's replies, from the engine thread to an event loop: per engine step, a
    list (a reply per choice with news), then the end, or the error that ended it."""

    def __init__(self, request: GenerateRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.group: SequenceGroup | None = None  # set on the engine thread once added
        self.finished = False  # its end (or error) has been read
        self._loop = loop
        # list[Reply]: a step's; None: the end; an exception: the error that ended it
        self._queue: asyncio.Queue[list[Reply] | Exception | None] = asyncio.Queue()
        self._ahead: collections.deque[list[Reply] | Exception | None] = collections.deque()

    def _push(self, item: list[Reply] | Exception | None) -> None:  # engine thread
        # a reader whose event loop has closed reads no more: that must not stop the thread
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def next(self) -> list[Reply] | None:
        """The replies of every step since the last call, in step order (waiting for
        one); None once the request has ended. Raises the error that ended it."""
        if not self._ahead:
            self._ahead.append(await self._queue.get())
        while not self._queue.empty():
            self._ahead.append(self._queue.get_nowait())
        replies: list[Reply] = []
        while self._ahead and isinstance(self._ahead[0], list):
            replies += self._ahead.popleft()
        if replies:
            return replies
        self.finished = True
        end = self._ahead[0]  # stays: a later call ends the same way
        if end is not None:
            raise end
        return None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # the requests in the engine, by id
        self._idle_wait_s = idle_wait_s
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- API (any thread / event loop) ---------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Queue `request` for the engine thread; its stream gives its replies, or raises
        the engine's refusal (RequestError) at the first read."""
        stream = RequestStream(request, asyncio.get_running_loop())
        self._submit(lambda: self._add(stream))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End a request now (its caller gone): frees its KV blocks and slot reference. A
        request that has ended, or was never added, is left alone."""
        self._submit(lambda: self._abort(stream))

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

    def _add(self, stream: RequestStream) -> None:
        rid = stream.request.request_id
        if rid in self._streams:
            stream._push(RequestError(f"duplicate request id {rid!r}"))
            return
        try:
            stream.group = self.engine.add_request(stream.request).group
        except Exception as e:  # a refusal, or a bug: the caller's, not the loop's
            if not isinstance(e, RequestRefused):
                log.exception("adding request %s failed", rid)
            stream._push(e)
            return
        self._streams[rid] = stream

    def _deliver(self, outputs: StepReplies) -> None:
        for group, replies in outputs.items():
            stream = self._streams.get(group.request.request_id)
            if stream is None or stream.group is not group:
                continue  # aborted: no one reads it
            if replies:
                stream._push(replies)
            if group.error is not None:
                self._end(stream, group.error)
            elif group.finished:
                self._end(stream, None)

    def _end(self, stream: RequestStream, error: RequestRefused | None) -> None:
        del self._streams[stream.request.request_id]
        stream._push(error)

    def _abort(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request.request_id) is stream:
            del self._streams[stream.request.request_id]
            self.engine.abort(stream.group.first)

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            self.engine.abort(stream.group.first, "error")
            self._end(stream, Unavailable(f"generation failed: {message}"))


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
