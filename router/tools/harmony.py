"""gpt-oss's harmony format: the answer is a run of messages, each a header, then
`<|message|>`, its body and `<|end|>`, `<|call|>` or `<|return|>` (or the end of the
text: the replica's final special token is not in it). The header names the channel
(`<|channel|>analysis`, `commentary`, `final`) and, for a call, the recipient
(`to=functions.get_weather`). Analysis is thinking, final and commentary text is the
answer, a message to a function is a call with its body as the arguments (held until
whole; a body that is not a JSON object stays text). The markers are special tokens:
the text is decoded keeping them.
"""

from __future__ import annotations

import json
import re

from router.tools.events import CallArguments, CallStart, Event, Reasoning, Text

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class HarmonyParser:
    def __init__(self, calls: bool = True) -> None:
        """`calls`: read messages to functions as calls (tool_choice auto); else text."""
        self.calls = calls
        self._text = ""  # undecided: a header, or the end of a body that may be a marker
        self._body: str | None = None  # inside a body: where it goes ("reasoning", ...)
        self._call: str | None = None  # the function the body's message is sent to
        self._held = ""  # a call's body so far

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        while True:
            if self._body is None:
                at = self._text.find(MESSAGE)
                if at < 0:
                    return events
                self._open(self._text[:at])
                self._text = self._text[at + len(MESSAGE) :]
            cut, marker = _first_end(self._text)
            if cut < 0:
                keep = _partial_end(self._text)
                events += self._body_text(self._text[: len(self._text) - keep])
                self._text = self._text[len(self._text) - keep :]
                return events
            events += self._body_text(self._text[:cut]) + self._close()
            self._text = self._text[cut + len(marker) :]

    def finish(self) -> list[Event]:
        text, self._text = self._text, ""
        if self._body is None:  # a header never finished: as written
            return [Text(text)] if text else []
        return self._body_text(text) + self._close()

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._call = recipient.group(1) if recipient and self.calls else None
        name = channel.group(1) if channel else "final"
        self._body = "call" if self._call else ("reasoning" if name == "analysis" else "text")

    def _body_text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._body == "call":
            self._held += text
            return []
        return [Reasoning(text) if self._body == "reasoning" else Text(text)]

    def _close(self) -> list[Event]:
        events: list[Event] = []
        if self._body == "call":
            body, self._held = self._held, ""
            try:
                arguments = json.loads(body)
            except ValueError:
                arguments = None
            if isinstance(arguments, dict) and self._call:
                events = [CallStart(self._call), CallArguments(json.dumps(arguments))]
            elif body:
                events = [Text(body)]
        self._body = self._call = None
        return events


def _first_end(text: str) -> tuple[int, str]:
    found = [(i, m) for m in ENDS if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _partial_end(text: str) -> int:
    """Length of the longest end of `text` that begins an end marker."""
    longest = 0
    for marker in ENDS:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest
