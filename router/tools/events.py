"""What a parser reads out of a choice's generated text, in order, as the text streams.

Every parser is a StreamParser: `feed` takes the text a step adds and returns what is
decided so far; `finish` returns the rest once the text is whole. A whole answer is parsed
by one `feed` and `finish`, a stream by many: the events of any split of the text add up
to the same message, so a streamed answer reassembles into the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Text:
    """Answer text (the message's content)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """Thinking text (the message's reasoning_content)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its function's name; its arguments follow."""

    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of the current call's arguments (JSON text)."""

    fragment: str


Event = Text | Reasoning | CallStart | CallArguments


class StreamParser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """The events `text` (the next piece of the output) decides."""
        ...

    def finish(self) -> list[Event]:
        """The events held back, once the output has ended."""
        ...


class PlainText:
    """No parsing: all text is answer text."""

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []


class Chain:
    """Two parsers in a row: `first`'s Text events are `second`'s input (reasoning split
    off first, then tool calls read from the answer)."""

    def __init__(self, first: StreamParser, second: StreamParser) -> None:
        self.first, self.second = first, second

    def feed(self, text: str) -> list[Event]:
        return self._through(self.first.feed(text))

    def finish(self) -> list[Event]:
        return self._through(self.first.finish()) + self.second.finish()

    def _through(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            out += self.second.feed(event.text) if isinstance(event, Text) else [event]
        return out
