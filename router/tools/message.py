"""One chat choice's parser events as OpenAI shapes: the stream's delta per step, and the
whole message (content, reasoning_content, tool_calls) at the end.

A call gets its index (its place among the choice's calls) and id when it starts; the
stream sends index, id, type and name first, then the arguments as fragments. With
parallel_tool_calls false, calls after the first are dropped. A message with calls has
content null unless the model also wrote text.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replica.wire import StructuredOutput
from router.tools.events import CallArguments, CallStart, Event, Reasoning, StreamParser, Text


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class DeltaParts:
    """What one step adds to the message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta entries

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class MessageAssembler:
    def __init__(self, parser: StreamParser, parallel_tool_calls: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel_tool_calls
        self.content = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []  # {"id", "type", "function": {name, arguments}}
        self._dropping = False  # inside a call parallel_tool_calls=false drops

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> DeltaParts:
        """What `text` (the choice's next text) adds."""
        return self._add(self.parser.feed(text))

    def finish(self) -> DeltaParts:
        """What the parser held back, now the text has ended."""
        return self._add(self.parser.finish())

    def message(self) -> dict[str, Any]:
        """The whole assistant message, for a non-streamed answer."""
        content: str | None = self.content
        if self.calls and not content:
            content = None
        return {
            "role": "assistant",
            "content": content,
            "reasoning_content": self.reasoning or None,
            "tool_calls": self.calls,
        }

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: `tool_calls` for a choice that stopped after calling."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _add(self, events: list[Event]) -> DeltaParts:
        parts = DeltaParts()
        for event in events:
            if isinstance(event, Text):
                parts.content += event.text
                self.content += event.text
            elif isinstance(event, Reasoning):
                parts.reasoning += event.text
                self.reasoning += event.text
            elif isinstance(event, CallStart):
                self._dropping = bool(self.calls) and not self.parallel
                if not self._dropping:
                    self._start(parts, event.name)
            elif not self._dropping:
                self._arguments(parts, event)
        return parts

    def _start(self, parts: DeltaParts, name: str) -> None:
        call = {
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        self.calls.append(call)
        parts.tool_calls.append(
            {
                "index": len(self.calls) - 1,
                "id": call["id"],
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _arguments(self, parts: DeltaParts, event: CallArguments) -> None:
        if not self.calls:
            return
        self.calls[-1]["function"]["arguments"] += event.fragment
        index = len(self.calls) - 1
        last = parts.tool_calls[-1] if parts.tool_calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += event.fragment
        else:
            parts.tool_calls.append({"index": index, "function": {"arguments": event.fragment}})


@dataclass(frozen=True)
class ChatAnswers:
    """How one chat request's answers read: a parser per choice (made by `parser`)."""

    parser: Callable[[], StreamParser]
    parallel_tool_calls: bool = True
    special_tokens: bool = False  # the call markers are special tokens: decode keeping them
    constraint: StructuredOutput | None = None  # strict tools' calls (replaces the request's)

    def assemblers(self, n: int) -> list[MessageAssembler]:
        return [MessageAssembler(self.parser(), self.parallel_tool_calls) for _ in range(n)]
