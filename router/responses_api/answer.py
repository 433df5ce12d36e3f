"""The chat path's result as a Responses API answer: a Response object, or its events.

Output items come in the order the model wrote them, step by step: a reasoning item for
thinking, a message item (one output_text part) for text, a function_call item per call.
The whole answer is its stream's items fed at once, so the two agree. A choice cut by
max_output_tokens is status "incomplete" (reason max_output_tokens).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import RootModel

from replica.wire import Reply
from router.choices import LogprobFormatter, RequestOutput
from router.responses_api.request import ResponsesRequest
from router.streams import Streams, deltas, error_event
from router.tools.message import DeltaParts, MessageAssembler

ResponseBody = RootModel[dict[str, Any]]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items as its text streams: each event the step makes, and the
    items so far."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the last item, while it grows

    def add(self, parts: DeltaParts) -> list[dict[str, Any]]:
        """The events of one step's parts: thinking, then text, then calls."""
        events: list[dict[str, Any]] = []
        if parts.reasoning:
            events += self._text("reasoning", parts.reasoning)
        if parts.content:
            events += self._text("message", parts.content)
        for call in parts.tool_calls:
            function = call["function"]
            if "id" in call:
                events += self.close()
                item = {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._opened("function_call", item)
            if function.get("arguments"):
                item = self.items[-1]
                item["arguments"] += function["arguments"]
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        **self._where(),
                        "delta": function["arguments"],
                    }
                )
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that end the last item, if one is open."""
        kind, self._open = self._open, None
        if kind is None:
            return []
        item, where = self.items[-1], self._where()
        item["status"] = "completed"
        events: list[dict[str, Any]] = []
        if kind == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_text.done", **where, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]  # fmt: skip
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
            )
        else:
            events.append(
                {"type": "response.function_call_arguments.done", **where,
                 "name": item["name"], "arguments": item["arguments"]}
            )  # fmt: skip
        where.pop("item_id")
        return [*events, {"type": "response.output_item.done", **where, "item": item}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != kind:
            events += self.close()
            if kind == "message":
                item = {"type": "message", "id": _id("msg"), "role": "assistant",
                        "status": "in_progress", "content": []}  # fmt: skip
                events += self._opened(kind, item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item["content"].append(part)
                events.append(
                    {"type": "response.content_part.added", **self._where(), "content_index": 0,
                     "part": dict(part)}
                )  # fmt: skip
            else:
                item = {"type": "reasoning", "id": _id("rs"), "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
                events += self._opened(kind, item)
        self.items[-1]["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        event = {"type": f"response.{name}.delta", **self._where(), "content_index": 0}
        event["delta"] = text
        if kind == "message":
            event["logprobs"] = []
        return [event]

    def _opened(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = kind
        snapshot = json.loads(json.dumps(item))
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1,
             "item": snapshot}
        ]  # fmt: skip

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


class ResponsesFront:
    """The Responses API's answers to one request (the ingress's chat path calls
    `response` for a whole answer, `sse` for a stream)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.id = _id("resp")
        self.created = int(time.time())

    def response(
        self,
        messages: list[MessageAssembler] | None,
        request_id: str,
        model: str,
        output: RequestOutput,
        logprobs: LogprobFormatter | None,
    ) -> ResponseBody:
        assert messages is not None  # a chat request
        items, message = OutputItems(), messages[0]
        items.add(message.feed(output.choices[0].text))
        items.add(message.finish())
        items.close()
        return ResponseBody(self._object(model, items.items, output))

    async def sse(
        self,
        streams: Streams,
        firsts: list[list[Reply]],
        output: RequestOutput,
        request: tuple[str, str],  # model, request id
        messages: list[MessageAssembler] | None,
        usage: tuple[bool, bool],
        logprobs: LogprobFormatter | None,
        on_end: Callable[[str], None],
    ) -> AsyncIterator[str]:
        """response.created, in_progress, each item's events, then response.completed
        (or incomplete); an `error` event if it fails after the 200."""
        assert messages is not None
        model, request_id = request
        sequence = 0

        def event(body: dict[str, Any]) -> str:
            nonlocal sequence
            body = {**body, "sequence_number": sequence}
            sequence += 1
            return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"

        items, message = OutputItems(), messages[0]
        outcome = "abort"  # unless the stream ends below: the client went away
        try:
            start = self._object(model, [], None)
            yield event({"type": "response.created", "response": start})
            yield event({"type": "response.in_progress", "response": start})
            async for delta in deltas(streams, firsts, output):
                for body in items.add(message.feed(delta.text)):
                    yield event(body)
                if delta.finish_reason is not None:
                    for body in items.add(message.finish()) + items.close():
                        yield event(body)
            outcome = output.finish_reason or "stop"
            whole = self._object(model, items.items, output)
            kind = "completed" if whole["status"] == "completed" else "incomplete"
            yield event({"type": f"response.{kind}", "response": whole})
        except Exception as e:  # after the 200 header only an error event can tell the client
            status, text = error_event(e, request_id)
            outcome = str(status)
            yield event({"type": "error", "code": str(status), "message": text, "param": None})
        finally:
            streams.give_up()
            on_end(outcome)

    def _object(
        self, model: str, items: list[dict[str, Any]], output: RequestOutput | None
    ) -> dict[str, Any]:
        """The Response object: in progress (no output yet) or as it ended."""
        status, incomplete, usage = "in_progress", None, None
        if output is not None:
            cut = output.choices[0].finish_reason == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            u = output.usage()
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": model,
            "output": json.loads(json.dumps(items)),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "truncation": "disabled",
            "metadata": {},
            "usage": usage,
            **self.request.echo(),
        }
