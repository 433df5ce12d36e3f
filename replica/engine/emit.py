"""A step's draws turned into replies: each token appended to its choice, choices 1..n-1
forked from their prefill, the choices that ended finished, and one wire.Reply per choice
with news, grouped by request (what LLMEngine.step returns).

Host-only, after the step's one device read; the only device work it asks for is the
KV block copies of forked choices (through the executor).
"""

from __future__ import annotations

from collections.abc import Callable

from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence, SequenceGroup
from replica.engine.step_draw import Draw, StepDraw
from replica.wire import Reply, TokenLogprobs

# A step's news: per request that has some, one reply per choice that has some. A request
# whose group has an `error` failed: its failing choice has no reply.
StepReplies = dict[SequenceGroup, list[Reply]]


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
        out: StepReplies,
    ) -> None:
        """Scored prompt positions collected; each drawn token appended to its choice;
        new choices forked from their prefill; the choices that ended finished; a reply
        for each drawn token added to `out`."""
        for (seq, _), scored in zip(draw.scored, prompt):
            seq.group.prompt_logprobs += scored
        reasons = [self._append(d.seq, t, lp) for d, t, lp in zip(draw.draws, tokens, logprobs)]
        self._fork(draw.draws, reasons)
        for d, token, lp, reason in zip(draw.draws, tokens, logprobs, reasons):
            if reason is not None:
                self.finish(d.seq, reason)
            self._reply(out, d.seq, token, lp, reason)

    def end_scoring(self, sampled: list[Sequence], out: StepReplies) -> None:
        """Requests with max_tokens 0 whose prefill is done: every choice ends ("length")
        without a token; choice 0's reply carries the prompt logprobs."""
        for seq in sampled:
            if seq.sampling.max_tokens == 0:
                for s in seq.choices:
                    self.finish(s, "length")
                    self._reply(out, s, None, None, "length")

    def _reply(
        self,
        out: StepReplies,
        seq: Sequence,
        token: int | None,
        logprobs: TokenLogprobs | None,
        reason: str | None,
    ) -> None:
        replies = out.setdefault(seq.group, [])
        if reason == "error":  # the request fails (group.error): no reply tells of it
            return
        replies.append(
            Reply(
                token_ids=() if token is None else (token,),
                finish_reason=reason,  # "stop", "length" or None
                index=seq.index,
                num_prompt_tokens=len(seq.prompt_ids),
                num_cached_tokens=seq.num_cached_tokens or 0,
                logprobs=() if logprobs is None else (logprobs,),
                prompt_logprobs=self._prompt_logprobs(seq),
                stop_token=seq.stop_token,
            )
        )

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Add a drawn token to its choice; returns why the choice ends with it, if it does."""
        seq.output_ids.append(token)
        self.scheduler.policy.generated(seq)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.sampling
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            seq.group.error = f"structured output: the grammar refused token {token}"
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
        """All of a request's prompt logprobs, with choice 0's first reply after its
        prefill (None for every other reply)."""
        group = seq.group
        if group is None or seq is not group.first or group.prompt_logprobs is None:
            return None
        if group.prompt_logprobs_sent:
            return None
        group.prompt_logprobs_sent = True
        return tuple(group.prompt_logprobs)
