"""A step's draws turned into outputs: each token appended to its choice, choices 1..n-1
forked from their prefill, the choices that ended finished, prompt logprobs handed over.

Host-only, after the step's one device read; the only device work it asks for is the
KV block copies of forked choices (through the executor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence
from replica.engine.step_draw import Draw, StepDraw
from replica.wire import TokenLogprobs


@dataclass
class StepOutput:
    seq: Sequence  # one choice of a request
    new_token: int | None  # None when it ended without a token (abort, error, max_tokens 0)
    finished: bool
    logprobs: TokenLogprobs | None = None  # the new token's, when the request asked
    # choice 0's first output of a request asking for prompt logprobs: all of them
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


class Emitter:
    def __init__(
        self,
        scheduler: Scheduler,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        copy_blocks: Callable[[list[int], list[int]], None],
        finish: Callable[[Sequence, str], None],
    ) -> None:
        self.scheduler, self.eos_token_ids = scheduler, eos_token_ids
        self.max_model_len, self.copy_blocks, self.finish = max_model_len, copy_blocks, finish

    def emit(
        self,
        draw: StepDraw,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        prompt: list[list[TokenLogprobs]],
    ) -> list[StepOutput]:
        """Scored prompt positions collected; each drawn token appended to its choice;
        new choices forked from their prefill; the choices that ended finished."""
        for (seq, _), scored in zip(draw.scored, prompt):
            seq.group.prompt_logprobs += scored
        reasons = [self._append(d.seq, t, lp) for d, t, lp in zip(draw.draws, tokens, logprobs)]
        self._fork(draw.draws, reasons)
        outputs = []
        for d, token, lp, reason in zip(draw.draws, tokens, logprobs, reasons):
            if reason is not None:
                self.finish(d.seq, reason)
            outputs.append(
                StepOutput(d.seq, token, reason is not None, lp, self._prompt_logprobs(d.seq))
            )
        return outputs

    def end_scoring(self, sampled: list[Sequence]) -> list[StepOutput]:
        """Requests with max_tokens 0 whose prefill is done: every choice ends ("length")
        without a token; choice 0's output carries the prompt logprobs."""
        outputs = []
        for seq in sampled:
            if seq.sampling.max_tokens == 0:
                for s in seq.choices:
                    self.finish(s, "length")
                    outputs.append(StepOutput(s, None, True, None, self._prompt_logprobs(s)))
        return outputs

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Add a drawn token to its choice; returns why the choice ends with it, if it does."""
        seq.output_ids.append(token)
        self.scheduler.policy.generated(seq)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.sampling
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            seq.error = f"structured output: the grammar refused token {token}"
            return "error"
        if token in p.stop_token_ids:
            seq.stop_token = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fork(self, draws: list[Draw], reasons: list[str | None]) -> None:
        """Choices 1..n-1 drawn with their choice 0's first token: those that go on get
        KV blocks with the prompt's K/V copied on the device (or wait to recompute)."""
        born: dict[int, list[Sequence]] = {}
        for d, reason in zip(draws, reasons):
            if d.seq.unborn and reason is None:
                born.setdefault(id(d.seq.group), []).append(d.seq)
        for d in draws:
            group = d.seq.group
            if group is not None and d.seq is group.first and not group.forked:
                src, dst = self.scheduler.fork(d.seq, born.get(id(group), []))
                if src:
                    self.copy_blocks(src, dst)
                group.forked = True

    def _prompt_logprobs(self, seq: Sequence) -> tuple[TokenLogprobs | None, ...] | None:
        """All of a request's prompt logprobs, with choice 0's first output after its
        prefill (None for every other output)."""
        group = seq.group
        if group is None or seq is not group.first or group.prompt_logprobs is None:
            return None
        if group.prompt_logprobs_sent:
            return None
        group.prompt_logprobs_sent = True
        return tuple(group.prompt_logprobs)
