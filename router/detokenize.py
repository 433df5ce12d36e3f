"""Incremental text for streaming: token ids -> text deltas -> text cut at stop strings.

IncrementalDetokenizer decodes a short window of recent tokens on each step instead of the
whole output (O(n) overall, not O(n^2)), as vLLM does. Decoding a window alone can differ
from the full decode at the window's *start* (a character cut in half, the leading space a
SentencePiece decoder strips), so the window keeps a few already-emitted tokens as context
and always starts where a character starts. A character can span several tokens (a
byte-level BPE, SentencePiece's byte fallback): while the text ends in U+FFFD it may still
change, and nothing is emitted until it does not. Byte fallback decodes a whole run of byte
tokens at once (one U+FFFD per byte while the run is not valid UTF-8), so a character
already emitted can turn back into U+FFFD for a few tokens: the window only ever starts at
a token where the text was complete, never inside such a run.
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
    then equals `tokenizer.decode(all_ids, skip_special_tokens=...)`. With `context_ids`
    (the prompt), the result is what the output adds to the context's text:
    `decode(context + output)` less `decode(context)`, so that the first output token keeps
    its leading space under a SentencePiece tokenizer (vLLM's behaviour). Context ids are
    decoded, never emitted.
    """

    # tokens of context the window keeps when it slides; it slides at twice this length
    CONTEXT = 8
    # a text still ending in U+FFFD after this many tokens is garbage (a character has at
    # most 4 bytes): emit it as it is rather than let the window grow
    MAX_WAIT = 4 * CONTEXT

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(context_ids)
        start = max(0, len(context) - self.CONTEXT)
        # a window starting inside a character decodes to U+FFFD there, and a byte fallback
        # run cut in two would stay U+FFFD: start a little earlier, at a character
        while 0 < start and len(context) - start < 2 * self.CONTEXT:
            if not self._decode(context[start:]).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        self._ids = context[start:]  # the window: decoding starts at its first token
        text = self._decode(self._ids)
        # characters of the window's text already emitted (or the context's). An
        # incomplete character at the context's end (at most 3 bytes, one U+FFFD each) is
        # not: the output may complete it.
        self._emitted = len(text) - min(3, len(text) - len(text.rstrip(REPLACEMENT_CHAR)))
        self._read = len(self._ids)  # tokens whose text is emitted
        self._marks = [self._read]  # positions where the text was complete: window starts

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes (often "", or several characters)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR) and len(self._ids) - self._read < self.MAX_WAIT:
            return ""  # an incomplete character: its tokens may still change it
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        self._read = len(self._ids)
        self._marks.append(self._read)
        if len(self._ids) > 2 * self.CONTEXT:
            self._slide()
        return delta

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an incomplete character, as U+FFFD)."""
        text = self._decode(self._ids)
        tail = text[self._emitted :]
        self._emitted, self._read = max(self._emitted, len(text)), len(self._ids)
        return tail

    def _slide(self) -> None:
        # restart the window at the latest complete position at least CONTEXT tokens back:
        # everything up to the window's end is emitted, so re-count from the new start
        cut = max((m for m in self._marks if m <= len(self._ids) - self.CONTEXT), default=0)
        if cut == 0:
            return
        self._ids = self._ids[cut:]
        self._marks = [m - cut for m in self._marks if m >= cut]
        self._read -= cut
        self._emitted = len(self._decode(self._ids))

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
