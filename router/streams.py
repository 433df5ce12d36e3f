"""One HTTP request's generations at the replicas: the handle calls' reply streams, read
until each choice ends or the deadline, and cancelled (KV and slot freed) by whoever
stops early: Serve's cancel reaches the replica running the call (CancelledError in
LoRAReplica.generate, which aborts the request there) or, not assigned yet, stops it
before it reaches one."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponseGenerator

from replica.wire import Reply
from router import protocol as p
from router.choices import RequestOutput
from router.errors import (
    APIError,
    BadRequestError,
    GatewayTimeoutError,
    NotFoundError,
    ServiceUnavailableError,
    TooManyRequestsError,
)


async def _next(stream: DeploymentResponseGenerator, deadline: float) -> Reply:
    """The stream's next message, or GatewayTimeoutError at the request's deadline."""
    try:
        return await asyncio.wait_for(stream.__anext__(), deadline - time.perf_counter())
    except asyncio.TimeoutError:
        raise GatewayTimeoutError("the request did not finish within its time limit") from None


async def _first_message(stream: DeploymentResponseGenerator, deadline: float) -> Reply:
    try:
        return await _next(stream, deadline)
    except StopAsyncIteration:
        raise ServiceUnavailableError("the replica ended the request without a reply") from None
    except APIError:
        raise
    except BackPressureError:  # Serve's queue for the replicas is full (max_queued_requests)
        raise TooManyRequestsError("the server is at capacity; retry later") from None
    except Exception as e:  # a replica that died or could not be reached
        raise ServiceUnavailableError(f"no replica could serve the request: {e}") from None


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
    """One HTTP request's GenerateRequests at the replicas: one per prompt, each a stream
    of Replies for its n choices. Whoever stops early (a stop string, an error, the
    deadline, a client gone) cancels the replica work still going, freeing its KV and slot."""

    def __init__(self, calls: list[DeploymentResponseGenerator], n: int) -> None:
        self.calls, self.n = calls, n
        self._ended: list[set[int]] = [set() for _ in calls]  # choices the replica finished

    async def first(self, deadline: float) -> list[Reply]:
        """Each stream's first message; a refusal, an error or a cancellation gives them
        all up."""
        try:
            firsts = await asyncio.gather(*(_first_message(c, deadline) for c in self.calls))
        except BaseException:  # an error, a timeout, the client gone: free their places
            self.give_up()
            raise
        refused = next((m for m in firsts if m.refused), None)
        if refused is not None:
            self.give_up()
            raise status_error(refused.status, refused.error)
        for i, message in enumerate(firsts):
            self._seen(i, message)
        return firsts

    async def rest(
        self, output: RequestOutput, deadline: float
    ) -> AsyncIterator[tuple[int, Reply]]:
        """(prompt, message) as messages arrive, until every choice of `output` has
        finished; the caller adds each to `output` before asking for the next."""
        pending: dict[asyncio.Future[Reply], int] = {}

        def want(i: int) -> None:
            if not output.prompt_done(i):
                pending[asyncio.ensure_future(self._next(i, deadline))] = i
            else:  # its choices have what they need (a stop string may end one early)
                self.give_up(i)

        for i in range(len(self.calls)):
            want(i)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    message = task.result()
                    self._seen(i, message)
                    yield i, message
                    want(i)
        finally:
            for task in pending:
                task.cancel()
            self.give_up()

    def give_up(self, only: int | None = None) -> None:
        """Cancel every stream (or stream `only`) whose replica work is not over."""
        for i, call in enumerate(self.calls):
            if only in (None, i) and len(self._ended[i]) < self.n:
                self._ended[i] = set(range(self.n))
                # a call that already failed (refused, replica gone) re-raises that error
                # from cancel(): then there is nothing to cancel
                with contextlib.suppress(Exception):
                    call.cancel()

    def _seen(self, i: int, message: Reply) -> None:
        if message.finished:
            self._ended[i].add(message.index)

    async def _next(self, i: int, deadline: float) -> Reply:
        try:
            return await _next(self.calls[i], deadline)
        except StopAsyncIteration:
            raise ServiceUnavailableError("the replica ended the stream early") from None
        except APIError:
            raise
        except Exception as e:
            raise ServiceUnavailableError(f"the replica failed mid-request: {e}") from None


def status_error(status: int, message: str) -> APIError:
    kinds = {400: BadRequestError, 404: NotFoundError}
    error = kinds.get(status, APIError)(message)
    error.status = status
    return error
