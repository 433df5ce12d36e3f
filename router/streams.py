"""One HTTP request's generations at the replicas: a handle call per prompt, each a stream
of messages (lists of wire.Replies, in step order) read until every choice of its prompt
has ended.

A replica's refusal is the exception it raised (replica/errors.py), which Ray hands over
wrapped in a RayTaskError: unwrapped here, once, into the HTTP error router/errors.py
maps it to. The replica owns the request's deadline; the ingress bounds only the wait for
a call's first message, for a call no replica has taken (queued at the handle). Whoever
stops early (a stop string, an error, a client gone) cancels the calls still going:
Serve's cancel reaches the replica running one (CancelledError in LoRAReplica.generate,
which aborts the request there) or, not assigned yet, stops it before it reaches one.

The answer's body is made here too: the whole response at once (`response`), or
server-sent events as the tokens come (`sse`)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
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
from router.choices import Delta, LogprobFormatter, RequestOutput
from router.errors import (
    APIError,
    GatewayTimeoutError,
    ServiceUnavailableError,
    TooManyRequestsError,
    refusal_error,
)
from router.http_app import printable
from router.tools.message import DeltaParts, MessageAssembler


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


log = logging.getLogger("router.ingress")  # the ingress's one log, whichever module writes


def response(
    messages: list[MessageAssembler] | None,
    request_id: str,
    model: str,
    output: RequestOutput,
    logprobs: LogprobFormatter | None,
) -> Any:
    """The whole answer: a choice per prompt and n, with logprobs and token ids when asked.
    `messages`: for chat, what reads each choice's text as a message (None: completions)."""
    chat = messages is not None
    ids = output.options.token_ids
    choices = []
    for c in output.choices:
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if ids:
            choice["token_ids"] = c.token_ids
        if messages is not None:
            message = messages[c.index]
            message.feed(c.text)
            message.finish()
            choice["message"] = message.message()
            choice["finish_reason"] = message.finish_reason(c.finish_reason)
            if logprobs is not None:
                choice["logprobs"] = logprobs.chat(c.logprobs)
        else:
            choice["text"] = c.text
            if logprobs is not None:
                choice["logprobs"] = logprobs.completion(c.logprobs, c.first_token)
            if ids:
                choice["prompt_token_ids"] = c.prompt_ids
        choices.append(choice)
    usage = output.usage()
    if chat:
        prompt_ids = output.choices[0].prompt_ids if ids else None
        return p.ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, prompt_token_ids=prompt_ids
        )
    return p.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


async def deltas(
    streams: Streams, firsts: list[list[Reply]], output: RequestOutput
) -> AsyncIterator[Delta]:
    """What each message of the replicas adds to `output`'s choices, as they come."""
    for i, message in enumerate(firsts):
        for delta in output.add(i, message):
            yield delta
    async for i, message in streams.rest(output):
        for delta in output.add(i, message):
            yield delta


def error_event(e: Exception, request_id: str) -> tuple[int, str]:
    """(status, message) of an error that ends a stream after its 200 header: an
    APIError's own; a bug's logged with its traceback, the client gets none."""
    if isinstance(e, APIError):
        return e.status, printable(e.message)
    log.exception("internal error in the stream of %s", request_id)
    return 500, "internal server error; the server log has details"


async def sse(
    streams: Streams,
    firsts: list[list[Reply]],
    output: RequestOutput,
    request: tuple[str, str],  # model, request id
    messages: list[MessageAssembler] | None,  # chat: each choice's message; None: completions
    usage: tuple[bool, bool],
    logprobs: LogprobFormatter | None,
    on_end: Callable[[str], None],
) -> AsyncIterator[str]:
    """The answer as server-sent events: a chunk per new text of each choice, an error
    event if it fails after the 200, then [DONE]; `on_end(outcome)` once it has ended."""
    model, request_id = request
    chat = messages is not None
    include_usage, continuous_usage = usage
    created = int(time.time())
    chunk = p.ChatCompletionStreamResponse if chat else p.CompletionStreamResponse
    offsets = [0] * len(output.choices)  # completions' text_offset, per choice
    ids = output.options.token_ids
    prompt_ids_sent = [False] * len(output.choices)  # return_token_ids: with the first

    def event(delta: Delta, role: bool = False, parts: DeltaParts | None = None) -> str:
        choice: dict[str, Any] = {"index": delta.index, "finish_reason": delta.finish_reason}
        if messages is not None:
            choice["finish_reason"] = messages[delta.index].finish_reason(delta.finish_reason)
        if delta.finish_reason is not None:  # the last chunk of the choice says what ended it
            choice["stop_reason"] = delta.stop_reason
        extra: dict[str, Any] = {}
        if ids and not role:
            choice["token_ids"] = delta.token_ids
        if ids and not prompt_ids_sent[delta.index]:
            prompt_ids_sent[delta.index] = True
            prompt_ids = output.choices[delta.index].prompt_ids
            if not chat:
                choice["prompt_token_ids"] = prompt_ids
            elif delta.index == 0:  # chat: once, on the response (one prompt)
                extra["prompt_token_ids"] = prompt_ids
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else _delta(parts)
            if logprobs is not None and not role:
                choice["logprobs"] = logprobs.chat(delta.logprobs)
        else:
            choice["text"] = delta.text
            if logprobs is not None:
                lp = logprobs.completion(delta.logprobs, delta.first_token, offsets[delta.index])
                offsets[delta.index] += sum(map(len, lp.tokens))
                choice["logprobs"] = lp
        so_far = output.usage() if continuous_usage else None
        return p.sse_event(
            chunk(
                id=request_id,
                created=created,
                model=model,
                choices=[choice],
                usage=so_far,
                **extra,
            )
        )

    outcome = "abort"  # unless the stream ends below: the client went away
    try:
        if chat:
            for choice in output.choices:
                yield event(Delta(choice.index, ""), role=True)
        async for delta in deltas(streams, firsts, output):
            parts = None
            if messages is not None:
                parts = messages[delta.index].feed(delta.text)
                if delta.finish_reason is not None:
                    parts = _joined(parts, messages[delta.index].finish())
                said = bool(parts)
            else:
                said = bool(delta.text)
            if said or delta.finish_reason or delta.logprobs or (ids and delta.token_ids):
                yield event(delta, parts=parts)
        outcome = output.finish_reason
        if include_usage:
            yield p.sse_event(
                chunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=output.usage(),
                )
            )
    except Exception as e:  # after the 200 header only an error event can tell the client
        status, message = error_event(e, request_id)
        outcome = str(status)
        yield f"data: {json.dumps(p.error_body(status, message))}\n\n"
    finally:
        # the client gone mid-stream closes this generator, not the inner ones (their
        # own finally would cancel only when garbage collected): cancel now
        streams.give_up()
        on_end(outcome)
    yield p.SSE_DONE


def _delta(parts: DeltaParts | None) -> dict[str, Any]:
    """A chat chunk's delta: content ("" when the step adds nothing else, as plain chat
    always sent), reasoning_content and tool_calls when there are any."""
    parts = parts or DeltaParts()
    delta: dict[str, Any] = {"content": parts.content}
    if not parts.content and (parts.reasoning or parts.tool_calls):
        delta["content"] = None
    if parts.reasoning:
        delta["reasoning_content"] = parts.reasoning
    if parts.tool_calls:
        delta["tool_calls"] = parts.tool_calls
    return delta


def _joined(first: DeltaParts, second: DeltaParts) -> DeltaParts:
    calls = list(first.tool_calls)
    for call in second.tool_calls:  # a call's fragments stay one entry
        if calls and calls[-1]["index"] == call["index"] and "id" not in call:
            calls[-1]["function"]["arguments"] += call["function"]["arguments"]
        else:
            calls.append(call)
    return DeltaParts(first.content + second.content, first.reasoning + second.reasoning, calls)
