"""Batch metadata shared by every multi-LoRA kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentInfo:
    """How the flattened token batch maps onto adapter slots.

    Tokens are grouped in segments (one per sequence, contiguous). Device
    tensors are filled by the engine on the host and copied non_blocking, so
    no kernel launcher may read their values; the host ints below exist for
    exactly that reason.
    """

    seg_indptr: (
        torch.Tensor
    )  # [G+1] int32: token offsets; segment g = rows [indptr[g], indptr[g+1])
    seg_slots: torch.Tensor  # [G] int32: adapter slot per segment; 0 = base model (no LoRA)
    slot_ranks: torch.Tensor  # [S] int32: rank of the adapter in each slot (0 for slot 0)
    slot_scalings: torch.Tensor  # [S] float32: alpha/r (or alpha/sqrt(r) for rsLoRA) per slot
    max_seg_len: int  # host: longest segment, sizes the Triton grid without a sync
    has_lora: bool  # host: False when every segment is slot 0 (the whole LoRA path is skipped)

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]


def make_segment_info(
    seg_lens: list[int],
    seg_slots: list[int],
    slot_ranks: list[int],
    slot_scalings: list[float],
    device: torch.device | str = "cpu",
) -> SegmentInfo:
    """Build a SegmentInfo from host lists (tests and simple callers)."""
    indptr = [0]
    for n in seg_lens:
        indptr.append(indptr[-1] + n)
    return SegmentInfo(
        seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        seg_slots=torch.tensor(seg_slots, dtype=torch.int32, device=device),
        slot_ranks=torch.tensor(slot_ranks, dtype=torch.int32, device=device),
        slot_scalings=torch.tensor(slot_scalings, dtype=torch.float32, device=device),
        max_seg_len=max(seg_lens, default=0),
        has_lora=any(s != 0 for s, n in zip(seg_slots, seg_lens) if n > 0),
    )
