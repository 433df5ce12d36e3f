"""One HTTP request's generations at the replicas: a handle call per prompt, each a stream
of messages (lists of wire.Replies, in step order) read until every choice of its prompt
has ended.

A replica's refusal is the exception it raised (replica/errors.py), which Ray hands over
wrapped in a RayTaskError: unwrapped here, once, into the HTTP error router/errors.py
maps it to. The replica owns the request's deadline; the ingress bounds only the wait for
a call's first message, for a call no replica has taken (queued at the handle). Whoever
stops early (a stop string, an error, a client gone) cancels the calls still going:
Serve's cancel reaches the replica running one (CancelledError in LoRAReplica.generate,
which aborts the request there) or, not assigned yet, stops it before it reaches one."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayTaskError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponseGenerator

from replica.errors import RequestRefused
from replica.wire import Reply
from router import protocol as p
from router.choices import RequestOutput
from router.errors import (
    GatewayTimeoutError,
    ServiceUnavailableError,
    TooManyRequestsError,
    refusal_error,
)


async def _message(call: DeploymentResponseGenerator) -> list[Reply]:
    """The call's next message; StopAsyncIteration once the replica has ended it. A
    replica's refusal raises as the HTTP error it is answered with."""
    try:
        return await call.__anext__()
    except StopAsyncIteration:
        raise
    except RequestRefused as e:
        raise refusal_error(e.cause if isinstance(e, RayTaskError) else e) from None
    except BackPressureError:  # Serve's queue for the replicas is full (max_queued_requests)
        raise TooManyRequestsError("the server is at capacity; retry later") from None
    except Exception as e:  # a replica that died or could not be reached
        raise ServiceUnavailableError(f"the replica failed: {e}") from None


def own_request_id(call: Callable[[], Any]) -> Any:
    """Make a handle call under a Serve internal request id of its own. Serve's request
    router indexes requests waiting for a replica by that id, which a call inherits from
    the HTTP request's context: two calls of one request (a batch of prompts) waiting at
    once collide there and one never reaches a replica (Ray 2.5x). Our own give-up
    cancels these calls; Serve's recursive cancellation tracks only the first."""

    def run() -> Any:
        serve_context._set_request_context(_internal_request_id=p.random_uuid())
        return call()

    return contextvars.copy_context().run(run)


class Streams:
    """One HTTP request's GenerateRequests at the replicas, one call per prompt. Which
    choices have ended is the RequestOutput's to say; this knows which calls are over."""

    def __init__(self, calls: list[DeploymentResponseGenerator]) -> None:
        self.calls = calls
        self._over = [False] * len(calls)  # the replica ended it, or it was cancelled

    async def first(self, deadline: float) -> list[list[Reply]]:
        """Each call's first message, by `deadline` (perf_counter; a replica that has the
        request answers, or times it out, before). A refusal, an error or a cancellation
        gives them all up."""
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(self._first(c) for c in self.calls)),
                deadline - time.perf_counter(),
            )
        except TimeoutError:
            self.give_up()
            raise GatewayTimeoutError("no replica took the request within its time limit") from None
        except BaseException:  # an error, the client gone: free their places
            self.give_up()
            raise

    async def rest(self, output: RequestOutput) -> AsyncIterator[tuple[int, list[Reply]]]:
        """(prompt, message) as messages arrive, until every choice of `output` has
        finished; the caller adds each to `output` before asking for the next."""
        pending: dict[asyncio.Future[list[Reply]], int] = {}

        def want(i: int) -> None:
            if not output.prompt_done(i):
                pending[asyncio.ensure_future(self._next(i))] = i
            elif output.prompt_ended(i):  # the replica ended every choice: its call is over
                self._over[i] = True
            else:  # a stop string ended them early: the replica's work is not wanted
                self.give_up(i)

        for i in range(len(self.calls)):
            want(i)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    yield i, task.result()
                    want(i)
        finally:
            for task in pending:
                task.cancel()
            self.give_up()

    def give_up(self, only: int | None = None) -> None:
        """Cancel every call (or call `only`) whose replica work is not over."""
        for i, call in enumerate(self.calls):
            if only in (None, i) and not self._over[i]:
                self._over[i] = True
                # a call that already failed (refused, replica gone) re-raises that error
                # from cancel(): then there is nothing to cancel
                with contextlib.suppress(Exception):
                    call.cancel()

    async def _first(self, call: DeploymentResponseGenerator) -> list[Reply]:
        try:
            return await _message(call)
        except StopAsyncIteration:
            raise ServiceUnavailableError("the replica ended the request without a reply") from None

    async def _next(self, i: int) -> list[Reply]:
        try:
            return await _message(self.calls[i])
        except StopAsyncIteration:
            self._over[i] = True
            raise ServiceUnavailableError("the replica ended the stream early") from None
