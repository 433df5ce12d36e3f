"""Incremental text for streaming: token ids -> text deltas -> text cut at stop strings.

IncrementalDetokenizer decodes a short window of recent tokens on each step instead of the
whole output (O(n) overall, not O(n^2)). Decoding a window alone can differ from the full
decode at the window's *start* (a character cut in half, a leading space a SentencePiece
decoder strips), never at its *end*: so the window keeps a few already-emitted tokens as
context, and positions are counted from the end of the window's text. A byte-level BPE
splits one character over several tokens; while the text ends in the replacement character
U+FFFD its last character may still change, so that one character is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What we need of a Hugging Face tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is the full decode.

    After the last `add`, call `flush` for a held-back incomplete character: the result
    then equals `tokenizer.decode(all_ids, skip_special_tokens=...)`. `context_ids` (say,
    the prompt) are decoded for context but never emitted, as vLLM does so that the first
    output token keeps its leading space under a SentencePiece tokenizer.
    """

    # tokens of context the window keeps when it slides; it slides at twice this length
    CONTEXT = 8

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = list(context_ids[-self.CONTEXT :])
        # characters at the end of the window's text not emitted yet (0 or 1)
        self._held = 0
        self._emitted = len(self._decode(self._window))

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes (often "", or several characters)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        stable = len(text) - 1 if text.endswith(REPLACEMENT_CHAR) else len(text)
        delta = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        self._held = len(text) - self._emitted
        if len(self._window) > 2 * self.CONTEXT:
            self._slide()
        return delta

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an incomplete character, as U+FFFD)."""
        text = self._decode(self._window)
        tail = text[self._emitted :]
        self._emitted, self._held = len(text), 0
        return tail

    def _slide(self) -> None:
        # the held tail lies within the last few tokens (a character is at most 4 bytes), so
        # cutting CONTEXT tokens back leaves it intact: re-count what is emitted from the end
        self._window = self._window[-self.CONTEXT :]
        self._emitted = len(self._decode(self._window)) - self._held

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts streamed text at the first stop string, OpenAI/vLLM style.

    The emitted text never contains a stop string nor anything after it. Text that could be
    the beginning of a stop string is held back until the next delta decides it; `flush`
    returns it when the stream ends without a stop. With no stop strings, text passes
    through at once. `matched` is the stop string that ended the text (vLLM's stop_reason).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(stop)
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit). After a hit: ("", True)."""
        if self.matched is not None:
            return "", True
        text = self._pending + delta
        hit = self._first_stop(text)
        if hit is not None:
            start, self.matched = hit
            self._pending = ""
            return text[:start], True
        keep = self._partial_stop_len(text)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Held-back text, for a stream that ended without a stop string."""
        text, self._pending = self._pending, ""
        return text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # the stop a character-by-character reader meets first: earliest end, then earliest
        # start (for "abc" and "bc" in "xabc" the output is "x")
        found = [(i + len(s), i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
