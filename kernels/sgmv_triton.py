"""Triton SGMV kernels for the multi-LoRA ops: CUDA, or CPU under TRITON_INTERPRET=1.

Imported lazily by `kernels.lora_shrink` / `kernels.lora_expand` when the
triton backend is chosen, so importing `kernels` never needs triton.

Both kernels launch one program per (segment, token block, slice x column
block[, K split]). The grid is sized from host ints only (number of segments,
SegmentInfo.max_seg_len, the buffers' R and the slice widths): no launcher
reads a device value, and none makes or caches a device tensor: the slice
offsets travel as kernel scalars, so a captured CUDA graph reads only tensors
its caller owns (a cached one would be freed under the graph once evicted). A
program whose segment is slot 0 or empty, or whose block lies past its
segment's tokens or its slot's rank, returns after a few scalar loads, so slot
0 costs nothing but those. Accumulation is fp32.

Two kernel families. Decode batches (every segment one token, the engine's
decode steps) run BGMV-style kernels: one program per token, tl.sum over a
[rank, K-chunk] or [N-block, rank] tile, no matrix units, shrink with a K split
so that a few tokens still fill the GPU. Everything else runs SGMV tile kernels
(tl.dot; 16-row tiles for segments of <= SMALL_TILE_TOKENS tokens, 64 above).
On an H100 the BGMV pair beats the tile pair at decode (docs/performance.md).

Adapters sit in arenas at their own rank (kernels/__init__.py): a program loads its
slot's first arena row (slot_offsets) and reads rank rows from there. The H100 figures
above were measured with slot-stacked buffers, before the arenas; a program reads the
same bytes in the same pattern (r contiguous elements per B row), not yet re-measured.

Tiles are widened to fp32 before tl.dot: one code path for every dtype, exact
products for fp16/bf16 under tf32, and the interpreter's bf16 dot (wrong in
triton 3.9) is never used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.segments import SMALL_TILE_TOKENS, SegmentInfo
from kernels.triton_launch import check_launch

_MAX_SLICES = 4  # slice offsets travel as the scalars C0..C4
# Specialisations a batch's sizes would otherwise multiply (kernels.warm_up compiles the
# rest at start): the metadata and the step's LoRA workspace are read at whatever
# address the step's packing gives them, and the slice offsets are only compared.
_METADATA = ["indptr_ptr", "seg_slots_ptr", "ranks_ptr", "offsets_ptr"]
_SHRINK_UNALIGNED = [*_METADATA, "out_ptr"]
_EXPAND_UNALIGNED = [*_METADATA, "scalings_ptr", "inter_ptr"]
_SLICE_OFFSETS = ["C0", "C1", "C2", "C3", "C4"]


@triton.jit
def _slice_columns(j, C0, C1, C2, C3, C4):
    """Columns [c0, c1) of slice j < _MAX_SLICES."""
    c0 = tl.where(j == 0, C0, tl.where(j == 1, C1, tl.where(j == 2, C2, C3)))
    c1 = tl.where(j == 0, C1, tl.where(j == 1, C2, tl.where(j == 2, C3, C4)))
    return c0, c1


@triton.jit(do_not_specialize_on_alignment=_SHRINK_UNALIGNED)
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slices, P, K]: the A arena
    out_ptr,  # [T, num_slices*R] fp32, zeroed when SPLIT_K > 1
    indptr_ptr,  # [G+1] int32
    seg_slots_ptr,  # [G] int32
    ranks_ptr,  # [S] int32
    offsets_ptr,  # [S] int32: each slot's first arena row
    K,
    R,
    stride_xt,
    stride_aj,
    stride_ar,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid = tl.program_id(2)
    pid_k = pid % SPLIT_K
    n_blocks = tl.cdiv(R, BLOCK_N)
    j = pid // SPLIT_K // n_blocks  # slice
    pid_n = pid // SPLIT_K % n_blocks

    slot = tl.load(seg_slots_ptr + g)
    if slot == 0:
        return
    end = tl.load(indptr_ptr + g + 1)
    m0 = tl.load(indptr_ptr + g) + pid_m * BLOCK_M
    rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    n0 = pid_n * BLOCK_N
    if m0 >= end or n0 >= rank:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_n = offs_n < rank
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    row0 = tl.load(offsets_ptr + slot).to(tl.int64)
    a_rows = a_ptr + j.to(tl.int64) * stride_aj + (row0 + offs_n)[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xk = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        ak = tl.load(a_rows + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(xk.to(tl.float32), ak.to(tl.float32), input_precision=PRECISION)

    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + (j * R + offs_n)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit(do_not_specialize=_SLICE_OFFSETS, do_not_specialize_on_alignment=_EXPAND_UNALIGNED)
def _expand_kernel(
    inter_ptr,  # [T, num_slices*R] fp32
    b_ptr,  # [N, P]: the B arena
    y_ptr,  # [T, N], updated in place
    indptr_ptr,  # [G+1] int32
    seg_slots_ptr,  # [G] int32
    ranks_ptr,  # [S] int32
    scalings_ptr,  # [S] fp32
    offsets_ptr,  # [S] int32: each slot's first arena row
    C0,  # C0..C4: the slice offsets (host ints, repeated past the last slice)
    C1,
    C2,
    C3,
    C4,
    R,
    N_BLOCKS,  # column blocks per slice (of the widest slice)
    stride_it,
    stride_bn,
    stride_br,  # 1 for contiguous B; any other (the torch path's rank-major layout) works
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid = tl.program_id(2)
    j = pid // N_BLOCKS  # slice
    pid_n = pid % N_BLOCKS

    slot = tl.load(seg_slots_ptr + g)
    if slot == 0:
        return
    end = tl.load(indptr_ptr + g + 1)
    m0 = tl.load(indptr_ptr + g) + pid_m * BLOCK_M
    c0, c1 = _slice_columns(j, C0, C1, C2, C3, C4)
    n0 = c0 + pid_n * BLOCK_N
    rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    if m0 >= end or n0 >= c1 or rank == 0:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_n = offs_n < c1
    t_rows = inter_ptr + offs_m.to(tl.int64)[:, None] * stride_it + j * R
    row0 = tl.load(offsets_ptr + slot).to(tl.int64)
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + row0 * stride_br
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):  # bounded by this slot's rank, not R
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        t = tl.load(t_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(
            b_cols + offs_k[:, None] * stride_br,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(t, w.to(tl.float32), input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
    acc *= tl.load(scalings_ptr + slot)

    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=_SHRINK_UNALIGNED)
def _shrink_bgmv_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slices, P, K]: the A arena
    out_ptr,  # [T, num_slices*R] fp32, zeroed when SPLIT_K > 1
    indptr_ptr,  # [G+1] int32
    seg_slots_ptr,  # [G] int32
    ranks_ptr,  # [S] int32
    offsets_ptr,  # [S] int32: each slot's first arena row
    K,
    R,
    stride_xt,
    stride_aj,
    stride_ar,
    stride_ot,
    BLOCK_R: tl.constexpr,  # >= R
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    g = tl.program_id(0)
    row = tl.load(indptr_ptr + g) + tl.program_id(1)
    j = tl.program_id(2) // SPLIT_K  # slice
    pid_k = tl.program_id(2) % SPLIT_K
    slot = tl.load(seg_slots_ptr + g)
    if slot == 0 or row >= tl.load(indptr_ptr + g + 1):
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    row0 = tl.load(offsets_ptr + slot).to(tl.int64)
    a_rows = a_ptr + j.to(tl.int64) * stride_aj + (row0 + offs_r)[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    out = out_ptr + row.to(tl.int64) * stride_ot + j * R + offs_r
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask_r)
    else:
        tl.atomic_add(out, acc, mask=mask_r)


@triton.jit(do_not_specialize=_SLICE_OFFSETS, do_not_specialize_on_alignment=_EXPAND_UNALIGNED)
def _expand_bgmv_kernel(
    inter_ptr,  # [T, num_slices*R] fp32
    b_ptr,  # [N, P]: the B arena
    y_ptr,  # [T, N], updated in place
    indptr_ptr,  # [G+1] int32
    seg_slots_ptr,  # [G] int32
    ranks_ptr,  # [S] int32
    scalings_ptr,  # [S] fp32
    offsets_ptr,  # [S] int32: each slot's first arena row
    C0,  # C0..C4: the slice offsets (host ints, repeated past the last slice)
    C1,
    C2,
    C3,
    C4,
    R,
    N_BLOCKS,  # column blocks per slice (of the widest slice)
    stride_it,
    stride_bn,
    stride_br,  # 1 for contiguous B; any other (the torch path's rank-major layout) works
    stride_yt,
    BLOCK_R: tl.constexpr,  # >= R
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    row = tl.load(indptr_ptr + g) + tl.program_id(1)
    j = tl.program_id(2) // N_BLOCKS  # slice
    slot = tl.load(seg_slots_ptr + g)
    if slot == 0 or row >= tl.load(indptr_ptr + g + 1):
        return
    c0, c1 = _slice_columns(j, C0, C1, C2, C3, C4)
    n0 = c0 + tl.program_id(2) % N_BLOCKS * BLOCK_N
    rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    if n0 >= c1 or rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < c1
    t = tl.load(inter_ptr + row.to(tl.int64) * stride_it + j * R + offs_r, mask=mask_r, other=0.0)
    row0 = tl.load(offsets_ptr + slot).to(tl.int64)
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + row0 * stride_br
    w = tl.load(
        b_rows + offs_r[None, :] * stride_br, mask=mask_n[:, None] & mask_r[None, :], other=0.0
    )
    acc = tl.sum(w.to(tl.float32) * t[None, :], axis=1) * tl.load(scalings_ptr + slot)
    y = y_ptr + row.to(tl.int64) * stride_yt + offs_n
    old = tl.load(y, mask=mask_n, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def _check_launch(seg: SegmentInfo, *tensors: torch.Tensor) -> None:
    """check_launch's checks, and contiguous metadata."""
    check_launch("LoRA ops", _shrink_kernel, *tensors)
    meta = (seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings, seg.slot_offsets)
    if not all(t.is_contiguous() for t in meta):
        raise ValueError("triton LoRA ops need contiguous SegmentInfo tensors")


def _precision(dtype: torch.dtype, fp32_operand: bool = False) -> str:
    # Tiles are widened to fp32 before tl.dot (one code path for every dtype, and
    # the interpreter's bf16 dot is wrong). tf32 holds fp16/bf16 values exactly,
    # so half data keeps exact products; fp32 data needs a true fp32 dot. Expand's
    # fp32 intermediate loses 2^-11 in tf32, about one fp16 ulp (seen on an H100:
    # 2.6e-3 off where y cancels), so fp16 expand uses three tf32 passes.
    if dtype == torch.float32:
        return "ieee"
    return "tf32x3" if fp32_operand and dtype == torch.float16 else "tf32"


def shrink_config(max_seg_len: int, k: int, r_max: int, dtype: torch.dtype) -> dict:
    """Tile configuration of _shrink_kernel for a batch (host ints only)."""
    if max_seg_len <= SMALL_TILE_TOKENS:
        # one token per segment: few programs, so split K (atomics into a zeroed output)
        cfg = dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=max(1, min(8, k // 512)))
    else:
        cfg = dict(BLOCK_M=64, BLOCK_K=64, SPLIT_K=1)
    return cfg | dict(BLOCK_N=16 if r_max <= 16 else 32, PRECISION=_precision(dtype), num_warps=4)


def expand_config(max_seg_len: int, dtype: torch.dtype) -> dict:
    """Tile configuration of _expand_kernel for a batch (host ints only)."""
    block_m = 16 if max_seg_len <= SMALL_TILE_TOKENS else 64
    precision = _precision(dtype, fp32_operand=True)
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=16, PRECISION=precision, num_warps=4)


def _bgmv(seg: SegmentInfo) -> bool:
    """Decode batches (one token per segment) take the BGMV kernels."""
    return seg.max_seg_len == 1


def shrink_bgmv_config(k: int, r_max: int) -> dict:
    """Tile configuration of _shrink_bgmv_kernel (H100: hidden 512 and 4096, rank 16)."""
    block_r = max(16, triton.next_power_of_2(r_max))
    block_k = max(64, 4096 // block_r)  # a [rank, K-chunk] tile of 4096 elements
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=max(1, min(16, k // block_k)),
                num_warps=8)  # fmt: skip


def expand_bgmv_config(r_max: int) -> dict:
    """Tile configuration of _expand_bgmv_kernel (H100: hidden 512 and 4096, rank 16)."""
    block_r = max(16, triton.next_power_of_2(r_max))
    return dict(BLOCK_R=block_r, BLOCK_N=max(32, 2048 // block_r), num_warps=4)


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [num_slices, P, K], rows of unit stride
    seg: SegmentInfo,
    max_rank: int,
    out: torch.Tensor | None = None,  # [T, num_slices*R] float32 zeros, written in place
) -> torch.Tensor:  # [T, num_slices*R] float32
    """out[rows_g, j*R : j*R+r] = x[rows_g] @ a[j, o : o+r]ᵀ per segment g with
    slot s = seg_slots[g] != 0, r = slot_ranks[s], o = slot_offsets[s]; zero elsewhere
    (float32). Arguments are checked by kernels.lora_shrink; see kernels.reference."""
    _check_launch(seg, x, a)
    T, K = x.shape
    num_slices, r_max = a.shape[0], max_rank
    if out is None:
        out = torch.zeros(T, num_slices * r_max, dtype=torch.float32, device=x.device)
    if not seg.has_lora or T == 0 or seg.num_segments == 0:
        return out
    # one launch contract, two families: grid dims are (segment, row block, slice x rest)
    if _bgmv(seg):  # one program per token
        kernel, cfg = _shrink_bgmv_kernel, shrink_bgmv_config(K, r_max)
        grid = (seg.num_segments, seg.max_seg_len, num_slices * cfg["SPLIT_K"])
    else:
        kernel, cfg = _shrink_kernel, shrink_config(seg.max_seg_len, K, r_max, x.dtype)
        grid = (
            seg.num_segments,
            triton.cdiv(seg.max_seg_len, cfg["BLOCK_M"]),
            num_slices * triton.cdiv(r_max, cfg["BLOCK_N"]) * cfg["SPLIT_K"],
        )
    kernel[grid](
        x, a, out, seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_offsets, K, r_max,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), **cfg,
    )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N], updated in place
    inter: torch.Tensor,  # [T, num_slices*R] float32
    b: torch.Tensor,  # [N, P], any strides (rank rows contiguous is the tuned layout)
    seg: SegmentInfo,
    slice_offsets: list[int],  # host, [num_slices+1]
) -> torch.Tensor:  # y
    """y[rows_g, c0:c1] += scaling[s] * inter[rows_g, j*R : j*R+r] @ b[c0:c1, o : o+r]ᵀ per
    segment g with slot s != 0 and slice j = [c0, c1) = slice_offsets[j : j+2]; fp32
    accumulation rounded once into y.dtype. Arguments are checked by kernels.lora_expand."""
    _check_launch(seg, y, inter)
    num_slices = len(slice_offsets) - 1
    if num_slices > _MAX_SLICES:
        raise ValueError(f"triton lora_expand takes up to {_MAX_SLICES} slices, got {num_slices}")
    r_max = inter.shape[1] // num_slices
    width = max((c1 - c0 for c0, c1 in zip(slice_offsets, slice_offsets[1:])), default=0)
    cols = [*slice_offsets, *[slice_offsets[-1]] * (_MAX_SLICES - num_slices)]  # C0..C4
    if not seg.has_lora or y.shape[0] == 0 or seg.num_segments == 0 or width == 0:
        return y
    if _bgmv(seg):  # one program per token
        kernel, cfg = _expand_bgmv_kernel, expand_bgmv_config(r_max)
        rows = seg.max_seg_len
    else:
        kernel, cfg = _expand_kernel, expand_config(seg.max_seg_len, y.dtype)
        rows = triton.cdiv(seg.max_seg_len, cfg["BLOCK_M"])
    n_blocks = triton.cdiv(width, cfg["BLOCK_N"])
    kernel[(seg.num_segments, rows, num_slices * n_blocks)](
        inter, b, y, seg.seg_indptr, seg.seg_slots, seg.slot_ranks, seg.slot_scalings,
        seg.slot_offsets, *cols, r_max, n_blocks,
        inter.stride(0), b.stride(0), b.stride(1), y.stride(0), **cfg,
    )  # fmt: skip
    return y
