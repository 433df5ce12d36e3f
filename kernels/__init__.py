"""Multi-LoRA kernels: the only public names, one dispatch point.

    seg = make_segment_info(seg_lens, seg_slots, slot_ranks, slot_scalings, device)
    segs = make_segment_infos(seg_lens, seg_slots, {group: ranks}, slot_scalings, device)
    inter = lora_shrink(x, a, seg, num_slices)         # [T, num_slices*R] float32
    lora_expand(y, inter, b, seg, slice_offsets)       # y += LoRA delta, in place
    b = lora_b_buffer(num_slots, out, max_rank, device, dtype)  # B slots, fastest layout

Backends (kernels/backend.py, decided once): CUDA tensors go to Triton
(`kernels.sgmv_triton`, imported lazily), CPU tensors to the torch path
(`kernels.sgmv_torch`). LORAFLEET_KERNELS=triton|torch, read at import, or
`force_backend` forces either; Triton on CPU needs TRITON_INTERPRET=1 (the tests). Both ops
check shapes, dtypes, devices and metadata sizes here, before any backend runs;
neither reads a device value for that. `kernels.reference` is the slow oracle
both are tested against; `lorafleet bench kernels` times them.
"""

from __future__ import annotations

import functools

import torch

from kernels.backend import backend_for, force_backend, forced_backend, implementation
from kernels.segments import SegmentInfo, make_segment_info, make_segment_infos

__all__ = [
    "SegmentInfo",
    "make_segment_info",
    "make_segment_infos",
    "lora_shrink",
    "lora_expand",
    "backend_for",
    "force_backend",
    "forced_backend",
    "lora_b_buffer",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_b_buffer(
    num_slots: int, out_features: int, max_rank: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:  # [S, out_features, R], zeros
    """Zeroed B slots in the memory layout the device's backend reads fastest (every
    backend accepts any layout). Triton's kernels are tuned for contiguous B. The torch
    path gets them rank-major ([S, R, out] in memory, seen transposed): a slot's first
    r rank columns are then r whole rows, so the expand's matmul streams rows instead
    of r-of-R floats out of each, and a load writes rows too (measured on the 2-core
    CPU, 8 slots of r=16 in R=64, 1408 columns: the bmm 47 -> 21 us; a decode step's
    LoRA part ~20 % faster)."""
    if backend_for(torch.empty(0, device=device)) == "triton":
        return torch.zeros(num_slots, out_features, max_rank, device=device, dtype=dtype)
    rank_major = torch.zeros(num_slots, max_rank, out_features, device=device, dtype=dtype)
    return rank_major.transpose(1, 2)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, num_slices*R, in]; rows past a slot's rank are never read
    seg: SegmentInfo,
    num_slices: int = 1,
) -> torch.Tensor:  # [T, num_slices*R] float32
    """Semantics, per segment g with slot s = seg_slots[g] != 0, r = slot_ranks[s]:

        out[rows_g, j*R : j*R+r] = x[rows_g].float() @ a[s, j*R : j*R+r].float()ᵀ

    for each slice j, zero everywhere else (slot 0, past the rank). fp32/fp16/bf16
    inputs, fp32 accumulation and output. See kernels.reference.lora_shrink_reference.
    """
    _check_shrink(x, a, seg, num_slices)
    return implementation(x, "sgmv").lora_shrink(x, a, seg, num_slices)


def lora_expand(
    y: torch.Tensor,  # [T, out_total], updated in place
    inter: torch.Tensor,  # [T, num_slices*R] float32, from lora_shrink
    b: torch.Tensor,  # [S, out_total, R]; columns past a slot's rank are never read;
    # any strides (lora_b_buffer allocates the backend's fastest)
    seg: SegmentInfo,
    slice_offsets: list[int],  # host ints, [num_slices+1], non-decreasing
) -> torch.Tensor:  # y
    """Semantics, per segment g with slot s != 0, r = slot_ranks[s], per slice j with
    columns cols_j = slice_offsets[j] : slice_offsets[j+1]:

        y[rows_g, cols_j] += slot_scalings[s] * inter[rows_g, j*R : j*R+r] @ b[s, cols_j, :r]ᵀ

    accumulated in fp32 and rounded once into y.dtype; rows of slot-0 segments are
    left bit-identical. See kernels.reference.lora_expand_reference.
    """
    _check_expand(y, inter, b, seg, slice_offsets)
    return implementation(y, "sgmv").lora_expand(y, inter, b, seg, slice_offsets)


_SEG_DTYPES = (torch.int32, torch.int32, torch.int32, torch.float32)


@functools.lru_cache(maxsize=16)
def _check_seg(seg: SegmentInfo, num_slots: int, device: torch.device) -> None:
    # Memoized per SegmentInfo object (hashed by its tensors' identity): every
    # projection of a step checks the same one, and dtypes/shapes can't change.
    tensors = (seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings)
    if tuple(t.dtype for t in tensors) != _SEG_DTYPES or any(t.device != device for t in tensors):
        raise ValueError(
            "SegmentInfo: seg_indptr, seg_slots, slot_ranks must be int32 and slot_scalings "
            f"float32, all on {device}; got {[(t.dtype, str(t.device)) for t in tensors]}"
        )
    g = seg.seg_slots.shape[0] if seg.seg_slots.dim() == 1 else -1
    if seg.seg_indptr.shape != (g + 1,):
        shapes = f"{tuple(seg.seg_indptr.shape)}, seg_slots {tuple(seg.seg_slots.shape)}"
        raise ValueError(f"seg_indptr must be [G+1] for seg_slots [G]: seg_indptr {shapes}")
    if seg.slot_ranks.shape != (num_slots,) or seg.slot_scalings.shape != (num_slots,):
        raise ValueError(
            f"slot_ranks {tuple(seg.slot_ranks.shape)} / slot_scalings "
            f"{tuple(seg.slot_scalings.shape)}: expected [{num_slots}] (one per buffer slot)"
        )


def _check_shrink(x: torch.Tensor, a: torch.Tensor, seg: SegmentInfo, num_slices: int) -> None:
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} must be [T, in], a {tuple(a.shape)} [S, ns*R, in]"
        )
    if num_slices < 1 or a.shape[1] % num_slices:
        raise ValueError(
            f"lora_shrink: a's {a.shape[1]} rank rows don't split into {num_slices} slices"
        )
    if x.dtype not in _DTYPES or a.dtype != x.dtype:
        raise ValueError(f"lora_shrink: x {x.dtype} and a {a.dtype} must share one of {_DTYPES}")
    if a.device != x.device:
        raise ValueError(f"lora_shrink: x on {x.device}, a on {a.device}")
    _check_seg(seg, a.shape[0], x.device)


def _check_expand(
    y: torch.Tensor,
    inter: torch.Tensor,
    b: torch.Tensor,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> None:
    if y.dim() != 2 or inter.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"lora_expand: y {tuple(y.shape)} [T, out], inter {tuple(inter.shape)} [T, ns*R], "
            f"b {tuple(b.shape)} [S, out, R]"
        )
    num_slices = len(slice_offsets) - 1
    if inter.shape != (y.shape[0], num_slices * b.shape[2]) or b.shape[1] != y.shape[1]:
        raise ValueError(
            f"lora_expand: inter {tuple(inter.shape)} must be [{y.shape[0]}, {num_slices}*R] and "
            f"b {tuple(b.shape)} [S, {y.shape[1]}, R]"
        )
    offsets_ok = all(0 <= c0 <= c1 for c0, c1 in zip(slice_offsets, slice_offsets[1:]))
    if num_slices < 1 or not offsets_ok or slice_offsets[-1] > y.shape[1]:
        raise ValueError(
            f"lora_expand: slice_offsets {slice_offsets} must rise within [0, {y.shape[1]}]"
        )
    if y.dtype not in _DTYPES or b.dtype != y.dtype or inter.dtype != torch.float32:
        raise ValueError(
            f"lora_expand: y {y.dtype} / b {b.dtype} must match, inter {inter.dtype} fp32"
        )
    if not (y.device == inter.device == b.device):
        raise ValueError(f"lora_expand: y on {y.device}, inter on {inter.device}, b on {b.device}")
    _check_seg(seg, b.shape[0], y.device)
