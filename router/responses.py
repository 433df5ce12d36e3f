"""An answer's body: the whole response at once, or server-sent events as the tokens come."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from replica.wire import Reply
from router import protocol as p
from router.choices import Delta, LogprobFormatter, RequestOutput
from router.errors import APIError
from router.http_app import printable
from router.streams import Streams
from router.tools.message import DeltaParts, MessageAssembler

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
