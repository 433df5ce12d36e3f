"""LoRA on the token embedding: PEFT's lora_embedding_A read by token id, one backend.

The shrink of an embedding LoRA is x·Aᵀ with x one-hot, so it is a gather: each token
reads the column of its adapter's A at its token id. A gather of [T, R] values has no
GEMM to hand to Triton, and its shapes depend on host values only (T, R), so the same
torch ops serve CPU and CUDA, CUDA graphs included. The expand is lora_expand's.
"""

from __future__ import annotations

import torch

from kernels.segments import SegmentInfo


def lora_embedding_shrink(
    ids: torch.Tensor,  # [T] int64 token ids
    a: torch.Tensor,  # [1, P, vocab]: the embedding A arena
    seg: SegmentInfo,
    max_rank: int,
) -> torch.Tensor:  # [T, R] float32
    """See kernels.lora_embedding_shrink (arguments are checked there)."""
    t = ids.shape[0]
    lens = seg.seg_indptr[1:] - seg.seg_indptr[:-1]
    slots = torch.repeat_interleave(seg.seg_slots, lens, output_size=t)  # [T]
    ranks = seg.slot_ranks.index_select(0, slots)  # [T]; slot 0 has rank 0
    first = seg.slot_offsets.index_select(0, slots).long()
    cols = torch.arange(max_rank, device=ids.device)
    keep = cols[None, :] < ranks[:, None]  # [T, R]
    rows = (first[:, None] + cols[None, :]).clamp_(max=a.shape[1] - 1)  # [T, R]
    values = a[0][rows, ids[:, None]]  # [T, R]: row o + c of the arena, column ids[t]
    return torch.where(keep, values.float(), 0.0)  # rows past a rank belong to others
