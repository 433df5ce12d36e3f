"""What one HTTP request's choices say, from the replicas' Replies.

A completions request may carry several prompts, and each prompt asks for n choices: the
ingress sends one GenerateRequest per prompt, whose replica answers with lists of Replies,
each naming its choice (Reply.index) and adding to it.
Choice `prompt * n + index` of the response is ChoiceOutput's work: its text detokenized
incrementally with the prompt as context, cut at a stop string, echoed prompt first when
asked; its logprobs, in the shapes of the completions and chat APIs. RequestOutput holds
them all, with the request's usage and timing. Torch-free, Ray-free: a tokenizer is all
it needs.

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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from replica.wire import Reply, TokenLogprobs
from router import protocol as p

LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -inf


# -- incremental text: token ids -> text deltas -> text cut at stop strings ----------------------

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


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its ids and, with echo, the text to echo."""

    ids: list[int]
    echo: str | None = None


@dataclass(frozen=True)
class TextOptions:
    """How a request's choices turn tokens into text (the same for all of them)."""

    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    wants_prompt_logprobs: bool = False  # echo with logprobs: the echo waits for them
    token_ids: bool = False  # vLLM's return_token_ids: the ids beside the text
    # ids whose text is left out when they end a choice: the EOS of an answer decoded
    # keeping special tokens (a tool parser's markers are special tokens)
    hidden_end_tokens: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Delta:
    """What one Reply added to a choice: text, and the logprobs of its tokens (asked for)."""

    index: int  # the choice's index in the response
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token: int | None = None  # an echoed prompt's first token: it has no logprob
    token_ids: list[int] = field(default_factory=list)  # the generated ids behind `text`


class ChoiceOutput:
    """One choice's text so far: detokenized incrementally (with the prompt as context),
    cut at a stop string, after the echoed prompt when asked. Where the ingress tells
    which choices have finished: `finished` (its text is whole) and `ended` (the replica
    ended it; a stop string may finish a choice before)."""

    def __init__(
        self,
        index: int,
        tokenizer: Any,
        prompt: Prompt,
        options: TextOptions = TextOptions(),
    ) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, options.skip_special_tokens, prompt.ids)
        self.stop = StopStringMatcher(options.stop)
        self.include_stop_str = options.include_stop_str
        self.hidden_end_tokens = options.hidden_end_tokens
        self.num_tokens = 0
        # everything sent so far (the whole answer, when not streaming)
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.token_ids: list[int] = []  # generated, up to a stop string's end
        self.first_token: int | None = None
        self.finish_reason: str | None = None
        self.ended = False  # the replica has sent its last reply
        self.stop_token: int | None = None  # the replica's stop token that ended the choice
        # the echo not sent yet (text, and whether it waits for the prompt's logprobs)
        self._echo = prompt.echo
        self._echo_waits = prompt.echo is not None and options.wants_prompt_logprobs
        self._held: list[Delta] = []  # deltas made while the echo waits
        self._prompt_ids = prompt.ids

    @property
    def prompt_ids(self) -> list[int]:
        return self._prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string that cut the text, else the stop token id
        that ended it, else None (EOS, length)."""
        return self.stop.matched if self.stop.matched is not None else self.stop_token

    def add(
        self, message: Reply, prompt_logprobs: Sequence[TokenLogprobs | None] | None
    ) -> Delta | None:
        """What `message` adds to the choice (None while an echo waits for the prompt's
        logprobs, which come with choice 0's first reply)."""
        self.ended = self.ended or message.finished
        delta = self._delta(message, prompt_logprobs)
        if delta is not None:
            self.text += delta.text
            self.logprobs += delta.logprobs
            self.token_ids += delta.token_ids
            if delta.first_token is not None:
                self.first_token = delta.first_token
        return delta

    def _delta(
        self, message: Reply, prompt_logprobs: Sequence[TokenLogprobs | None] | None
    ) -> Delta | None:
        text, logprobs, ids = self._generated(message)
        delta = Delta(
            self.index, text, logprobs, self.finish_reason, self._stop_reason(), token_ids=ids
        )
        if self._echo is None:
            return delta
        if self._echo_waits and prompt_logprobs is None:
            self._held.append(delta)
            return None
        entries = [lp for lp in prompt_logprobs or () if lp is not None]
        echo = Delta(self.index, self._echo, entries, first_token=self._prompt_ids[0])
        self._echo = None
        return _joined([echo, *self._held, delta])

    def _generated(self, message: Reply) -> tuple[str, list[TokenLogprobs], list[int]]:
        """The text, logprobs and token ids `message` adds (tokens after a stop string's
        end are dropped)."""
        if self.finished:  # cut at a stop string already: the replica's late tokens
            return "", [], []
        text, logprobs, ids = "", list(message.logprobs), list(message.token_ids)
        last = len(ids) - 1 if message.finish_reason == "stop" else -1
        for i, token in enumerate(message.token_ids):
            self.num_tokens += 1
            if i == last and token in self.hidden_end_tokens:
                continue
            delta, stopped = self.stop.feed(self.detok.add(token))
            text += delta
            if stopped:
                return text + self._stopped(), logprobs[: i + 1], ids[: i + 1]
        if message.finished:
            delta, stopped = self.stop.feed(self.detok.flush())
            if stopped:
                return text + delta + self._stopped(), logprobs, ids
            text += delta + self.stop.flush()
            self.finish_reason = message.finish_reason
            if message.finish_reason == "stop":
                self.stop_token = message.stop_token
        return text, logprobs, ids

    def _stopped(self) -> str:
        """A stop string ended the text: what follows the text (the string, if kept)."""
        self.finish_reason = "stop"
        return (self.stop.matched or "") if self.include_stop_str else ""

    def _stop_reason(self) -> int | str | None:
        return self.stop_reason if self.finished else None


def _joined(deltas: list[Delta]) -> Delta:
    first, last = deltas[0], deltas[-1]
    return Delta(
        last.index,
        "".join(d.text for d in deltas),
        [lp for d in deltas for lp in d.logprobs],
        last.finish_reason,
        last.stop_reason,
        first.first_token,
        [t for d in deltas for t in d.token_ids],
    )


class RequestOutput:
    """Every choice of one HTTP request: `len(prompts) * n` ChoiceOutputs, choice
    `prompt * n + Reply.index`; the request's usage and timing."""

    def __init__(
        self,
        tokenizer: Any,
        prompts: Sequence[Prompt],
        n: int,
        start: float,
        options: TextOptions = TextOptions(),
    ) -> None:
        self.n, self.options = n, options
        self.choices = [
            ChoiceOutput(i * n + j, tokenizer, prompt, options)
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        self.num_prompt_tokens = [len(prompt.ids) for prompt in prompts]
        self.num_cached_tokens = [0] * len(prompts)
        self._prompt_logprobs: list[tuple[TokenLogprobs | None, ...] | None] = [None] * len(prompts)
        self.start = start  # time.perf_counter() at the request's arrival
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []  # one per token after the first (of the first choice)
        self._last_message = start

    def add(self, prompt: int, message: list[Reply]) -> list[Delta]:
        """What a message of `prompt`'s replica adds to its choices, reply by reply."""
        deltas = []
        for reply in message:
            if reply.prompt_logprobs is not None:
                self._prompt_logprobs[prompt] = reply.prompt_logprobs
            if reply.num_prompt_tokens:
                self.num_prompt_tokens[prompt] = reply.num_prompt_tokens
                self.num_cached_tokens[prompt] = reply.num_cached_tokens
            choice = self.choices[prompt * self.n + reply.index]
            if (delta := choice.add(reply, self._prompt_logprobs[prompt])) is not None:
                deltas.append(delta)
        if prompt == 0:
            self._time(sum(len(r.token_ids) for r in message if r.index == 0))
        return deltas

    def prompt_done(self, prompt: int) -> bool:
        """Whether every choice of `prompt` has finished (its replica work is no longer
        wanted)."""
        return all(c.finished for c in self._of(prompt))

    def prompt_ended(self, prompt: int) -> bool:
        """Whether the replica has ended every choice of `prompt` (its call is over)."""
        return all(c.ended for c in self._of(prompt))

    def _of(self, prompt: int) -> list[ChoiceOutput]:
        return self.choices[prompt * self.n : (prompt + 1) * self.n]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's: what the request's metrics record as its outcome."""
        return self.choices[0].finish_reason

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> p.UsageInfo:
        """Prompt tokens once per prompt (its n choices share one prefill), generated
        tokens of every choice; of the prompt tokens, those the prefix cache served."""
        return p.UsageInfo.of(
            sum(self.num_prompt_tokens), self.num_tokens, sum(self.num_cached_tokens)
        )

    def _time(self, n: int) -> None:
        if not n:
            return
        # A message carries the tokens made since the last one: they share its gap (the
        # first message's extra tokens came with the first token: gap 0).
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start
            self.itl_s += [0.0] * (n - 1)
        else:
            self.itl_s += [(now - self._last_message) / n] * n
        self._last_message = now


class LogprobFormatter:
    """TokenLogprobs as the API shows them: token ids as text (each token decoded alone,
    special tokens included, cached), logprobs floored at LOGPROB_FLOOR."""

    def __init__(self, tokenizer: Any, cache_size: int = 65536) -> None:
        self._decode: Callable[[int], str] = tokenizer.decode
        self._cache: dict[int, str] = {}
        self._cache_size = cache_size

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._cache) < self._cache_size:
                self._cache[token_id] = text
        return text

    def completion(
        self, entries: Sequence[TokenLogprobs], first_token: int | None = None, offset: int = 0
    ) -> Any:
        """The completions API's parallel lists. `first_token`: an echoed prompt's first
        token, listed first with null logprobs (as OpenAI does). `offset`: where the first
        token's text starts in the choice's text (a stream's later chunks continue it)."""
        out = p.CompletionLogprobs()

        def listed(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            token = self.token(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)

        if first_token is not None:
            listed(first_token, None, None)
        for e in entries:
            listed(e.token_id, _floor(e.logprob), {self.token(t): _floor(lp) for t, lp in e.top})
        return out

    def chat(self, entries: Sequence[TokenLogprobs]) -> Any:
        """The chat API's logprobs.content: one entry per generated token."""
        return p.ChatLogprobs(
            content=[
                p.ChatTokenLogprob(
                    **self._top(entry.token_id, entry.logprob),
                    top_logprobs=[p.TopLogprob(**self._top(t, lp)) for t, lp in entry.top],
                )
                for entry in entries
            ]
        )

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": _floor(logprob), "bytes": list(token.encode())}


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)
