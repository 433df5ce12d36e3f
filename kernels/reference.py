"""Slow, obviously-correct multi-LoRA ops: the oracle for every fast path.

Pure functions of their inputs: no config, no environment, no globals.
"""

from __future__ import annotations

import torch

from kernels.segments import SegmentInfo


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, max_rank: int
) -> torch.Tensor:
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s],
    o = slot_offsets[s], R = max_rank, for each slice j:

        out[rows_g, j*R : j*R + r] = x[rows_g] @ a[j, o : o + r, :]ᵀ   (float32)

    x: [T, in]; a: [num_slices, P, in], the A arena (each adapter holds rows
    [o, o + r) of every slice). Returns [T, num_slices*R] float32, zero where no
    adapter applies and past each slot's rank.
    """
    num_slices = a.shape[0]
    out = torch.zeros(x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
    indptr = seg.seg_indptr.tolist()
    ranks, offsets = seg.slot_ranks.tolist(), seg.slot_offsets.tolist()
    for g, slot in enumerate(seg.seg_slots.tolist()):
        lo, hi = indptr[g], indptr[g + 1]
        if slot == 0 or hi == lo:
            continue
        r, o = ranks[slot], offsets[slot]
        for j in range(num_slices):
            cols = slice(j * max_rank, j * max_rank + r)
            out[lo:hi, cols] = x[lo:hi].float() @ a[j, o : o + r].float().T
    return out


def lora_expand_reference(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:
    """Semantics, per segment g with slot s != 0, r = slot_ranks[s], o = slot_offsets[s],
    R = inter's columns / num_slices, per slice j covering output columns
    cols_j = [slice_offsets[j], slice_offsets[j+1]):

        y[rows_g, cols_j] += scaling[s] * inter[rows_g, j*R : j*R + r] @ b[cols_j, o : o + r]ᵀ

    y: [T, out_total] updated in place and returned; inter: [T, num_slices*R]
    float32 from lora_shrink; b: [out_total, P], the B arena. Accumulates in float32
    and rounds once into y's dtype.
    """
    r_max = inter.shape[1] // (len(slice_offsets) - 1)
    indptr = seg.seg_indptr.tolist()
    ranks, offsets = seg.slot_ranks.tolist(), seg.slot_offsets.tolist()
    scalings = seg.slot_scalings.tolist()
    for g, slot in enumerate(seg.seg_slots.tolist()):
        lo, hi = indptr[g], indptr[g + 1]
        if slot == 0 or hi == lo:
            continue
        r, o = ranks[slot], offsets[slot]
        acc = y[lo:hi].float()
        for j in range(len(slice_offsets) - 1):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            part = inter[lo:hi, j * r_max : j * r_max + r] @ b[c0:c1, o : o + r].float().T
            acc[:, c0:c1] += scalings[slot] * part
        y[lo:hi] = acc.to(y.dtype)
    return y


def lora_embedding_shrink_reference(
    ids: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, max_rank: int
) -> torch.Tensor:
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s],
    o = slot_offsets[s]:

        out[t, :r] = a[0, o : o + r, ids[t]]   for each row t of segment g   (float32)

    ids: [T] token ids; a: [1, P, vocab], the embedding A arena (PEFT's
    lora_embedding_A [r, vocab] in rows [o, o + r)). Returns [T, max_rank] float32, zero
    where no adapter applies and past each slot's rank: x·Aᵀ for one-hot x.
    """
    out = torch.zeros(ids.shape[0], max_rank, dtype=torch.float32, device=ids.device)
    indptr = seg.seg_indptr.tolist()
    ranks, offsets = seg.slot_ranks.tolist(), seg.slot_offsets.tolist()
    for g, slot in enumerate(seg.seg_slots.tolist()):
        if slot == 0:
            continue
        r, o = ranks[slot], offsets[slot]
        for t in range(indptr[g], indptr[g + 1]):
            out[t, :r] = a[0, o : o + r, int(ids[t])].float()
    return out
