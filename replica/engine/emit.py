"""A step's draws, its one device read, and the replies they become.

The draws: one per sampled sequence, except that the prefill completing a request of n
choices is drawn n times from its one logits row (its choices 1..n-1 fork from it), and a
request that only scores its prompt (max_tokens 0) draws nothing. The read (StepDraw): the
drawn ids, and when some row asks for them the logprob tables of drawn tokens and of
scored prompt positions, packed into one tensor so that the step still reads the device
once. The replies (Emitter): each token appended to its choice, choices 1..n-1 forked from
their prefill, the choices that ended finished, and one wire.Reply per choice with news,
grouped by request (what LLMEngine.step returns). Host-only after the read; the only
device work the Emitter asks for is the KV block copies of forked choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replica.device import to_device
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence, SequenceGroup
from replica.errors import RequestError
from replica.model.sampler import Row, Sampler, logprob_table, read_logprobs
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
            # the mask left no token: this vocabulary cannot write what the grammar requires
            # next (a draw from an all-masked row is never accepted)
            seq.group.error = RequestError(
                f"structured output: no token of the model's vocabulary can continue the "
                f"required output after {len(seq.output_ids) - 1} generated tokens"
            )
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


@dataclass(frozen=True)
class Draw:
    seq: Sequence
    row: int  # its logits row among the step's sampled rows


def step_draws(sampled: list[Sequence]) -> list[Draw]:
    """The step's draws, from its sampled sequences in logits-row order."""
    draws = []
    for row, seq in enumerate(sampled):
        if seq.sampling.max_tokens == 0:
            continue  # prompt logprobs only: the prefill was all it needed
        draws.append(Draw(seq, row))
        group = seq.group
        if group is not None and seq is group.first and not group.forked:
            draws += [Draw(child, row) for child in group.seqs[1:]]
    return draws


class StepDraw:
    """The step's draws and scored prompt positions: sample() on the device, read() on
    the host once the packed tensor has been read."""

    def __init__(self, draws: list[Draw], scored: list[tuple[Sequence, range]]) -> None:
        self.draws, self.scored = draws, scored
        self.with_logprobs = [j for j, d in enumerate(draws) if d.seq.sampling.logprobs is not None]
        self.k = max((draws[j].seq.sampling.logprobs or 0 for j in self.with_logprobs), default=0)
        self.targets = [seq.prompt_ids[p + 1] for seq, positions in scored for p in positions]
        self.prompt_k = max((seq.sampling.prompt_logprobs or 0 for seq, _ in scored), default=0)
        self.structured = [j for j, d in enumerate(draws) if d.seq.matcher is not None]

    @property
    def matchers(self) -> list:
        """The grammar matchers of structured draws, in bitmask-row order."""
        return [self.draws[j].seq.matcher for j in self.structured]

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        num_sampled: int,
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The one tensor the step reads: the drawn ids (int64) when no row wants
        logprobs, else float64 [ids, drawn tokens' tables, prompt positions' tables]."""
        raw = logits[:num_sampled]  # the sampled rows; scored prompt rows follow
        rows = [d.row for d in self.draws]
        if rows != list(range(num_sampled)):  # forks repeat a row, max_tokens 0 skip one
            # int64 explicitly: no draws (only max_tokens 0 rows) would make a float index
            index = torch.tensor(rows, dtype=torch.int64)
            raw = raw.index_select(0, to_device(index, logits.device))
        tokens = sampler.draw(raw, self._rows(), bitmask)
        if not self.with_logprobs and not self.targets:
            return tokens
        parts = [tokens.double()]
        if self.with_logprobs:
            at = to_device(torch.tensor(self.with_logprobs), logits.device)
            table = logprob_table(raw.index_select(0, at), tokens.index_select(0, at), self.k)
            parts.append(table.view(-1))
        if self.targets:
            targets = to_device(torch.tensor(self.targets), logits.device)
            parts.append(logprob_table(logits[num_sampled:], targets, self.prompt_k).view(-1))
        return torch.cat(parts)

    def read(
        self, values: list
    ) -> tuple[list[int], list[TokenLogprobs | None], list[list[TokenLogprobs]]]:
        """The packed tensor's values -> per draw its token and logprobs (None if not
        asked), per scored sequence the logprobs of its scored prompt tokens."""
        n = len(self.draws)
        tokens = [int(v) for v in values[:n]]
        logprobs: list[TokenLogprobs | None] = [None] * n
        width, at = 1 + 2 * self.k, n
        for j in self.with_logprobs:
            keep = self.draws[j].seq.sampling.logprobs or 0
            logprobs[j] = read_logprobs(tokens[j], values[at : at + width], self.k, keep)
            at += width
        width, targets = 1 + 2 * self.prompt_k, iter(self.targets)
        prompt = []
        for seq, positions in self.scored:
            keep = seq.sampling.prompt_logprobs or 0
            scored = []
            for _ in positions:
                scored.append(
                    read_logprobs(next(targets), values[at : at + width], self.prompt_k, keep)
                )
                at += width
            prompt.append(scored)
        return tokens, logprobs, prompt

    def _rows(self) -> list[Row]:
        bitmask_rows = {j: i for i, j in enumerate(self.structured)}
        return [
            Row(
                d.seq.key,
                d.seq.sampling,
                d.seq.index,
                d.seq.prompt_ids,
                len(d.seq.output_ids),
                bitmask_rows.get(j),
            )  # fmt: skip
            for j, d in enumerate(self.draws)
        ]
