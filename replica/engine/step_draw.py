"""What one step draws and reads back from the device.

The draws: one per sampled sequence, except that the prefill completing a request of n
choices is drawn n times from its one logits row (its choices 1..n-1 fork from it), and a
request that only scores its prompt (max_tokens 0) draws nothing. The read: the drawn ids,
and when some row asks for them the logprob tables of drawn tokens and of scored prompt
positions, packed into one tensor so that the step still reads the device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.device import to_device
from replica.engine.sequence import Sequence
from replica.model.sampler import Row, Sampler, logprob_table, read_logprobs
from replica.wire import TokenLogprobs


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
