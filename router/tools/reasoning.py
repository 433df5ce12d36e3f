"""Thinking split from the answer: `<think>...</think>` (Qwen3, Qwen3.5, DeepSeek-R1).

The thinking is the text between the markers when the answer begins with `<think>`, or
up to `</think>` when the prompt already opened it (templates that end the generation
prompt with `<think>`). Thinking cut off before `</think>` (max_tokens) is still
thinking. Whitespace between `</think>` and the answer is dropped.
"""

from __future__ import annotations

from router.tools.events import Event, Reasoning, Text

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, opened: bool = False) -> None:
        """`opened`: the prompt ends inside a `<think>` the template wrote."""
        self._state = "thinking" if opened else "before"  # "before" | "thinking" | "answer"
        self._text = ""  # not decided yet
        self._strip = False  # the answer's leading whitespace is still to drop

    def feed(self, text: str) -> list[Event]:
        self._text += text
        events: list[Event] = []
        if self._state == "before":
            stripped = self._text.lstrip()
            if stripped.startswith(START):
                self._state, self._text = "thinking", stripped[len(START) :]
            elif START.startswith(stripped):  # whitespace or the marker's beginning
                return events
            else:
                self._state = "answer"
        if self._state == "thinking":
            cut = self._text.find(END)
            if cut < 0:
                split = len(self._text) - _partial(self._text, END)
                thought, self._text = self._text[:split], self._text[split:]
                return [Reasoning(thought)] if thought else []
            thought, self._text = self._text[:cut], self._text[cut + len(END) :]
            events += [Reasoning(thought)] if thought else []
            self._state, self._strip = "answer", True
        if self._strip:
            self._text = self._text.lstrip()
            if not self._text:
                return events
            self._strip = False
        text, self._text = self._text, ""
        return events + ([Text(text)] if text else [])

    def finish(self) -> list[Event]:
        text, self._text = self._text, ""
        if not text or (self._strip and not text.strip()):
            return []
        return [Reasoning(text) if self._state == "thinking" else Text(text)]


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and is shorter)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
