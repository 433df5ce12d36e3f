"""Batch metadata of the Gated DeltaNet ops: sequences in the flattened token batch and
their rows of the per-sequence state pools."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateBatch:
    """How the flattened token batch maps onto sequences and their state-pool rows.

    Sequence i owns tokens [cu_seqlens[i], cu_seqlens[i+1]) and row state_slots[i] of
    every layer's conv and recurrent state pools; it starts from that row when
    has_initial_state[i] (a later chunk of its prompt, or a decode), from zeros otherwise
    (its first chunk: the row may hold anything, NaN included), and leaves its final
    state there. Device tensors are filled by the engine on the host and copied
    non_blocking, so no launcher reads their values: the host ints below size the work.
    """

    cu_seqlens: torch.Tensor  # [N+1] int32: token offsets, cu_seqlens[0] = 0
    state_slots: torch.Tensor  # [N] int32: each sequence's row of the state pools
    has_initial_state: torch.Tensor  # [N] bool: start from the pool row (else zeros)
    seq_lens: tuple[int, ...]  # host: tokens per sequence, each >= 1
    max_seq_len: int  # host: longest sequence, sizes the Triton grids without a sync

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """One token per sequence: a decode step, a fixed sequence of ops whatever the
        values (replayed as a CUDA graph)."""
        return self.max_seq_len == 1


def make_state_batch(
    seq_lens: Sequence[int],
    state_slots: Sequence[int],
    has_initial_state: Sequence[bool],
    device: torch.device | str = "cpu",
    copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StateBatch:
    """A StateBatch from host lists. `copy` moves a host tensor to `device` (default
    `.to(device)`; the engine passes a pinned, non_blocking copy)."""
    n = len(seq_lens)
    if len(state_slots) != n or len(has_initial_state) != n:
        raise ValueError(
            f"{n} sequence lengths, {len(state_slots)} state slots and "
            f"{len(has_initial_state)} has_initial_state flags: expected one of each per sequence"
        )
    if any(int(x) < 1 for x in seq_lens) or any(int(s) < 0 for s in state_slots):
        raise ValueError(f"seq_lens {list(seq_lens)} must be >= 1, state_slots >= 0")
    move = copy or (lambda t: t.to(device))
    cu = [0]
    for length in seq_lens:
        cu.append(cu[-1] + int(length))
    return StateBatch(
        cu_seqlens=move(torch.tensor(cu, dtype=torch.int32)),
        state_slots=move(torch.tensor([int(s) for s in state_slots], dtype=torch.int32)),
        has_initial_state=move(torch.tensor([bool(h) for h in has_initial_state])),
        seq_lens=tuple(int(x) for x in seq_lens),
        max_seq_len=max((int(x) for x in seq_lens), default=0),
    )
