"""Slow, obviously-correct multi-LoRA ops: the oracle for every fast path.

Pure functions of their inputs: no config, no environment, no globals.
"""

from __future__ import annotations

import torch

from kernels.segments import SegmentInfo


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, num_slices: int = 1
) -> torch.Tensor:
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s],
    R = a.shape[1] // num_slices, for each slice j:

        out[rows_g, j*R : j*R + r] = x[rows_g] @ a[s, j*R : j*R + r, :]ᵀ   (float32)

    x: [T, in]; a: [S, num_slices*R, in] (slices stacked along the rank axis,
    each padded to R = max_lora_rank). Returns [T, num_slices*R] float32, zero
    where no adapter applies and past each slot's rank.
    """
    r_max = a.shape[1] // num_slices
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    indptr = seg.seg_indptr.tolist()
    ranks = seg.slot_ranks.tolist()
    for g, slot in enumerate(seg.seg_slots.tolist()):
        lo, hi = indptr[g], indptr[g + 1]
        if slot == 0 or hi == lo:
            continue
        r = ranks[slot]
        for j in range(num_slices):
            rows = slice(j * r_max, j * r_max + r)
            out[lo:hi, rows] = x[lo:hi].float() @ a[slot, rows].float().T
    return out


def lora_expand_reference(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:
    """Semantics, per segment g with slot s != 0, r = slot_ranks[s], per slice j
    covering output columns cols_j = [slice_offsets[j], slice_offsets[j+1]):

        y[rows_g, cols_j] += scaling[s] * inter[rows_g, j*R : j*R + r] @ b[s, cols_j, :r]ᵀ

    y: [T, out_total] updated in place and returned; inter: [T, num_slices*R]
    float32 from lora_shrink; b: [S, out_total, R]. Accumulates in float32 and
    rounds once into y's dtype.
    """
    r_max = b.shape[2]
    indptr = seg.seg_indptr.tolist()
    ranks = seg.slot_ranks.tolist()
    scalings = seg.slot_scalings.tolist()
    for g, slot in enumerate(seg.seg_slots.tolist()):
        lo, hi = indptr[g], indptr[g + 1]
        if slot == 0 or hi == lo:
            continue
        r = ranks[slot]
        acc = y[lo:hi].float()
        for j in range(len(slice_offsets) - 1):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            part = inter[lo:hi, j * r_max : j * r_max + r] @ b[slot, c0:c1, :r].float().T
            acc[:, c0:c1] += scalings[slot] * part
        y[lo:hi] = acc.to(y.dtype)
    return y
