"""The streaming machine of call formats delimited by markers in the text.

Hermes writes `<tool_call>{...}</tool_call>` anywhere in the answer, Mistral
`[TOOL_CALLS][...]` to the end of it, Llama 3.1+ a bare JSON object that is the whole
answer. A CallFormat says where a call block starts and ends and how its body reads as
calls; TaggedCallParser finds the blocks as the text streams. A block whose body does not
read as calls, or that never ends, stays text, exactly as written: no half-parsed calls.
Whitespace between a call and the text around it is dropped (a template's newlines).
Text that may still begin a marker is held until the next piece decides it, as is
trailing whitespace (it is dropped if a call follows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.tools.events import CallArguments, CallStart, Event, Text

Call = tuple[str, str]  # the function's name, its arguments as JSON text
Decoder = Callable[[str], list[Call] | None]  # a block's body -> its calls; None: not calls


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str  # the marker a call block begins with
    end: str | None  # the marker it ends with; None: the block runs to the end of the text
    decode: Decoder
    anchored: bool = False  # a block only at the start of the answer (after whitespace)
    start_in_body: bool = False  # the start marker is the body's first character ("{")
    special_tokens: bool = False  # the markers are special tokens: decode keeping them
    # strict tools: what a call of a function begins and ends with around its arguments
    # (the grammar's tag), once the model writes `trigger`; None: not constrained
    wrap: Callable[[str], tuple[str, str]] | None = None
    trigger: str | None = None


class TaggedCallParser:
    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self._text = ""  # text not decided yet, outside blocks
        self._block: str | None = None  # inside a block: its body so far
        self._gap = ""  # the whitespace before the open block
        self._after_call = False  # whitespace here follows a call: dropped
        self._answered = False  # anchored: text decided already, no block may start

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._block is None:
            self._text += text
        else:
            self._block += text
        while True:
            if self._block is None:
                events += self._scan()
                if self._block is None:
                    return events
            end = self.fmt.end
            cut = -1 if end is None else self._block.find(end)
            if end is None or cut < 0:
                return events
            body, self._text = self._block[:cut], self._block[cut + len(end) :]
            self._block = None
            events += self._close(body, end)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._block is not None:
            body, self._block = self._block, None
            if self.fmt.end is None:
                events += self._close(body, "")
            else:  # never ended: what was written stays text
                events.append(Text(self._raw(body, "")))
        text, self._text = self._text, ""
        if self._after_call:
            text = text.lstrip()
        return events + ([Text(text)] if text else [])

    def _scan(self) -> list[Event]:
        """Text decided in self._text: answer text up to a block's start (which opens
        the block) or up to what may still begin a marker or be dropped whitespace."""
        text = self._text
        if self._after_call:
            text = text.lstrip()
            if not text:
                self._text = ""
                return []
            self._after_call = False
        start, undecided = self._find_start(text)
        if start is not None:
            before = text[:start]
            head = before.rstrip()
            self._gap = before[len(head) :]
            skip = 0 if self.fmt.start_in_body else len(self.fmt.start)
            self._block, self._text = text[start + skip :], ""
            return [Text(head)] if head else []
        head = text[: len(text) - undecided].rstrip()
        self._text = text[len(head) :]
        if head:
            self._answered = True
            return [Text(head)]
        return []

    def _find_start(self, text: str) -> tuple[int | None, int]:
        """(where a block starts in `text`, or None; how many characters at its end may
        still begin one)."""
        marker = self.fmt.start
        if self.fmt.anchored:
            if self._answered:
                return None, 0
            stripped = text.lstrip()
            if stripped.startswith(marker):
                return len(text) - len(stripped), 0
            if marker.startswith(stripped):  # whitespace, or the marker's beginning
                return None, len(text)
            return None, 0
        at = text.find(marker)
        if at >= 0:
            return at, 0
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return None, k
        return None, 0

    def _close(self, body: str, end: str) -> list[Event]:
        """A whole block: its calls, or its text as written when it does not read as calls."""
        calls = self.fmt.decode(body)
        if calls is None:
            self._answered = True
            return [Text(self._raw(body, end))]
        self._after_call = True
        events: list[Event] = []
        for name, arguments in calls:
            events += [CallStart(name), CallArguments(arguments)]
        return events

    def _raw(self, body: str, end: str) -> str:
        start = "" if self.fmt.start_in_body else self.fmt.start
        return self._gap + start + body + end
