"""Attention on CUDA (or CPU under TRITON_INTERPRET=1): prefill, then paged decode.

Imported lazily by `kernels.prefill_attention` and `kernels.paged_decode_attention` when
the triton backend is chosen, so importing `kernels` never needs triton.

## Prefill: SDPA's flash kernel where it applies, this module's Triton kernel for the rest

SDPA's flash kernel (fp16/bf16, GQA native) takes plain causal attention: is_causal when
the queries are the whole context, torch.nn.attention.bias.causal_lower_right when they
are its last n positions (a chunk after earlier ones, a prefix-cache hit). It has no
sliding window, no soft cap and no sinks, and no fp32 (SDPA would pick its efficient
kernel, which not every torch gives GQA: MATH then); those go to _prefill_kernel.

_prefill_kernel is flash attention's forward pass: one program per (BLOCK_M query rows,
query head), an online softmax in fp32 (base 2) over tiles of BLOCK_N key positions.
Query row i sits at position t = ctx - n + i and sees [max(0, t - window + 1), t]; a
program walks only the tiles some row of it sees (causal and window bounds both cut the
loop), masks the rest per element, and reads a position's K/V either at k[:, p] (the
fresh K/V of a whole prompt) or at k[:, slots[p]] (the paged cache: HAS_SLOTS). The soft
cap is the decode kernel's: scores capped right after the dot, before the mask and every
max; so are attention sinks (SINKS: the head's sink joins the denominator at the end). A
row can meet tiles before its window opens (all masked): the running max then stays -inf
and is replaced by 0 where it is subtracted, so those tiles add exactly 0. Dots and
precisions as in the decode kernel below (tiles widened to fp32).

## Paged decode

One program per (sequence, kv head, split): it loads the GROUP = H // KVH query rows of
that kv head (padded to a 16-row tile for tl.dot) and reads each K/V position once for
all of them. The grid is (D, KVH, num_splits), host ints only; the loop bounds come
from the sequence's context length, loaded inside the kernel, so nothing is sized by a
device value and a launch has the same shape at every context length (CUDA-graph
replayable).

Split-KV (flash-decoding): with num_splits = S > 1 a sequence's tiles are dealt out in
S runs of ceil(tiles / S), one per program (a short context leaves the last runs empty).
Each program writes its run's softmax-normalised fp32 output and its log2-sum-exp2;
_merge_splits_kernel, one program per (sequence, query head), weighs the runs by
2^(lse - max lse) and rounds once into the output's dtype. So at a small batch a long
context is read by D * KVH * S programs instead of D * KVH. S = 1 is the single-pass
kernel (SPLIT off: no partial buffers, no merge).

The loop walks positions [start, ctx), start = max(0, ctx - window), in tiles of
BLOCK_N positions aligned to BLOCK_N; a tile may span several cache blocks (block
size 1 or 4) or part of one. Each position looks up its block id in the table (a
gather load), so one code path serves every block size. Positions outside
[start, ctx) are masked at every load: no table entry past the context, no slot in
the tail of the last block, no block before the window is read. Online softmax in
fp32 (base 2, scale * log2(e) applied to the fp32 scores); every tile the loop visits
holds at least one attended position, so the running max is finite after the first.

Soft-capping (Gemma 2: s = cap * tanh(s / cap)) is a constexpr branch, SOFT_CAP: without
a cap the kernel compiles to exactly the uncapped code. With one, each tile's scores are
capped right after the Q·K dot, before the mask, the tile max and the running max, so
the online softmax only ever sees capped scores: qk_scale is then scale / cap and
cap_scale is cap * log2(e), i.e. s2 = cap * log2(e) * tanh(scale * q·k / cap). tanh is
_tanh below: libdevice's tanh does not run in the interpreter (it returns None there).

Attention sinks (gpt-oss: each head's softmax has one more logit, sinks[h], whose
probability weighs no value) are a constexpr branch too, SINKS: they change only the
denominator, so the online softmax runs as without them and the sink's exp2(sink *
log2(e) - m) joins l where the output is normalised (in the merge kernel, once, against
the splits' largest log-sum-exp).

Tiles are widened to fp32 before tl.dot (as in kernels.sgmv_triton: one code path for
every dtype, and the interpreter's bf16 dot is never used). Q·K in tf32 is exact for
fp16/bf16 data; P·V has fp32 probabilities, which tf32 rounds by 2^-11 (about one fp16
ulp), so fp16 takes three tf32 passes there; fp32 data uses true fp32 dots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kernels.triton_launch import check_launch

# Attending back this far is attending to everything: no context reaches it (int32).
_NO_WINDOW = 2**31 - 1
_LOG2E = math.log2(math.e)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [n, H, hd]
    k_ptr,  # [KVH, S, hd]
    v_ptr,  # [KVH, S, hd]
    out_ptr,  # [n, H, hd]
    slots_ptr,  # [ctx] int64 with HAS_SLOTS (unused without)
    sinks_ptr,  # [H] fp32 with SINKS (unused without)
    n,  # queries: the last n of the ctx positions
    ctx,
    qk_scale,  # fp32: softmax scale * log2(e); with SOFT_CAP, scale / cap
    cap_scale,  # fp32: cap * log2(e) with SOFT_CAP (unused without)
    window,  # int32: positions a row sees back from its own, inclusive
    head_dim,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per kv head
    HAS_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program, >= 16
    BLOCK_N: tl.constexpr,  # key positions per tile, >= 16
    BLOCK_D: tl.constexpr,  # >= head_dim, >= 16
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,  # the head's sink logit joins each row's softmax denominator
):
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = ctx - n + rows  # each row's position
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_q = (rows < n)[:, None] & mask_d[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=mask_q, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]

    first = ctx - n + tl.program_id(0) * BLOCK_M  # the first row's position
    hi = tl.minimum(first + BLOCK_M, ctx)  # keys end after the last row's position
    lo = tl.maximum(first - window + 1, 0)  # the first row's window opens here
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        loaded = (pos >= lo) & (pos < hi)
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + pos, mask=loaded, other=0)
        else:
            slot = pos.to(tl.int64)
        k = tl.load(
            k_head + slot[None, :] * stride_kt + offs_d[:, None],
            mask=mask_d[:, None] & loaded[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k.to(tl.float32), input_precision=QK_PRECISION) * qk_scale  # [BM, BN]
        if SOFT_CAP:  # before the mask and every max: the softmax sees capped scores only
            s = _tanh(s) * cap_scale
        seen = (pos[None, :] <= t[:, None]) & (pos[None, :] > t[:, None] - window)
        s = tl.where(seen & loaded[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + slot[:, None] * stride_vt + offs_d[None, :],
            mask=loaded[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
        m_i = m_new

    if SINKS:  # every stored row saw its own position: m is finite there
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        l_i += tl.where(m_i == float("-inf"), 0.0, tl.exp2(sink - m_i))
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only on rows past n (not stored)
    o_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_rows, o.to(out_ptr.dtype.element_ty), mask=mask_q)


def prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile configuration of _prefill_kernel (host ints only)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        qk, pv = "ieee", "ieee"
    else:
        qk, pv = "tf32", "tf32x3" if dtype == torch.float16 else "tf32"
    return dict(
        BLOCK_M=64 if block_d <= 128 else 32,
        BLOCK_N=64 if block_d <= 64 else 32,
        BLOCK_D=block_d,
        QK_PRECISION=qk,
        PV_PRECISION=pv,
        num_warps=4 if block_d <= 64 else 8,
    )


def flash_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel takes these [1, H, n, hd] / [1, KVH, ctx, hd] inputs
    with GQA (dtype, head dim, device capability): CUDA only. Asked without is_causal,
    as CausalBias asks for its lower-right form (flash refuses is_causal on n != ctx,
    whose meaning it changed)."""
    return q.is_cuda and can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, False, True))


def prefill_attention(
    q: torch.Tensor,  # [n, H, hd]
    k: torch.Tensor,  # [KVH, S, hd]
    v: torch.Tensor,  # [KVH, S, hd]
    scale: float,
    slots: torch.Tensor | None = None,  # [ctx] int64
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [n, H, hd], q.dtype
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit
) -> torch.Tensor:  # [n, H, hd], q.dtype
    """See kernels.prefill_attention (arguments are checked there) and
    kernels.attention_reference."""
    n = q.shape[0]
    ctx = k.shape[1] if slots is None else slots.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    if sliding_window is not None and sliding_window >= ctx:
        sliding_window = None  # a window past the first position is no window
    if sliding_window is None and soft_cap is None and sinks is None:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if flash_applies(qh, k.unsqueeze(0)):
            return _flash(qh, k, v, scale, slots, out)
    return prefill_attention_kernel(q, k, v, scale, slots, sliding_window, soft_cap, out, sinks)


def _flash(qh, k, v, scale, slots, out) -> torch.Tensor:
    """Causal SDPA on its flash kernel only (an input it refuses raises, never MATH)."""
    if slots is not None:
        k, v = k.index_select(1, slots), v.index_select(1, slots)
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, KVH, ctx, hd]
    n, ctx = qh.shape[2], kh.shape[2]
    causal = {"is_causal": True} if ctx == n else {"attn_mask": causal_lower_right(n, ctx)}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True, **causal)
    return out.copy_(o[0].transpose(0, 1))


def prefill_attention_kernel(
    q: torch.Tensor,  # [n, H, hd]
    k: torch.Tensor,  # [KVH, S, hd]
    v: torch.Tensor,  # [KVH, S, hd]
    scale: float,
    slots: torch.Tensor | None,  # [ctx] int64
    sliding_window: int | None,
    soft_cap: float | None,
    out: torch.Tensor,  # [n, H, hd], q.dtype
    sinks: torch.Tensor | None = None,  # [H] fp32
) -> torch.Tensor:
    """_prefill_kernel over every case (the tests call it directly). Reads no device
    value: the grid is (ceil(n / BLOCK_M), H), host ints."""
    check_launch("attention ops", _prefill_kernel, q, k, v, out)
    n, h, hd = q.shape
    ctx = k.shape[1] if slots is None else slots.shape[0]
    window = _NO_WINDOW if sliding_window is None else min(sliding_window, _NO_WINDOW)
    if soft_cap is None:
        qk_scale, cap_scale = scale * _LOG2E, 1.0
    else:
        qk_scale, cap_scale = scale / soft_cap, soft_cap * _LOG2E
    cfg = prefill_config(hd, q.dtype)
    grid = (triton.cdiv(n, cfg["BLOCK_M"]), h)
    _prefill_kernel[grid](
        q, k, v, out, k if slots is None else slots, q if sinks is None else sinks, n, ctx,
        qk_scale, cap_scale, window, hd,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), GROUP=h // k.shape[0], HAS_SLOTS=slots is not None,
        SOFT_CAP=soft_cap is not None, SINKS=sinks is not None, **cfg,
    )  # fmt: skip
    return out


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 alone, so it runs compiled and interpreted alike. Odd:
    tanh(|x|) with x's sign. |x| >= 1/8: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 0.78],
    no overflow (e -> 0 gives 1) and no cancellation (1 - e >= 0.22). |x| < 1/8, where
    1 - e would cancel: the Taylor series to x^7, whose next term is below 2^-29 |x|.
    NaN stays NaN."""
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2a): -2 * log2(e)
    big = (1.0 - e) / (1.0 + e)
    b = tl.minimum(a, 0.125)  # the series only where it is used: no overflow past it
    b2 = b * b
    c = b2 * -0.05396825396825397 + 0.13333333333333333  # -17/315, 2/15
    c = b2 * c - 0.3333333333333333  # -1/3
    small = b + b * b2 * c  # b - b^3/3 + 2b^5/15 - 17b^7/315
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend(
    q,  # [BLOCK_G, BLOCK_D] fp32: the group's query rows
    k_head,  # this kv head's K, at slot 0
    v_head,
    table,  # this sequence's row of the block table
    start,  # first attended position
    ctx,  # attended positions end here
    n_lo,  # first tile's position (a multiple of BLOCK_N)
    n_hi,  # the tiles end before this position
    qk_scale,
    cap_scale,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """The online softmax over the tiles in [n_lo, n_hi), each holding an attended
    position (or none at all: then acc = l = 0, m = -inf): (acc, l, m), base 2."""
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        attended = (pos >= start) & (pos < ctx)
        block = tl.load(table + pos // BLOCK_SIZE, mask=attended, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
        kv_mask = mask_d[:, None] & attended[None, :]  # [BLOCK_D, BLOCK_N]
        k = tl.load(k_head + slot[None, :] * stride_kt + offs_d[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k.to(tl.float32), input_precision=QK_PRECISION) * qk_scale  # [BG, BN]
        if SOFT_CAP:  # before the mask and every max: the softmax sees capped scores only
            s = _tanh(s) * cap_scale
        s = tl.where(attended[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile holds an attended pos
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + slot[:, None] * stride_vt + offs_d[None, :],
            mask=attended[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [D, H, hd]
    k_ptr,  # [KVH, slots, hd]
    v_ptr,  # [KVH, slots, hd]
    out_ptr,  # [D, H, hd]; with SPLIT, [D, H, S, hd] fp32: each split's normalised output
    lse_ptr,  # with SPLIT, [D, H, S] fp32: each split's log2-sum-exp2 (unused without)
    sinks_ptr,  # with SINKS, [H] fp32: each head's sink logit (unused without)
    tables_ptr,  # [D, W] int32
    lens_ptr,  # [D] int32
    qk_scale,  # fp32: softmax scale * log2(e); with SOFT_CAP, scale / cap
    cap_scale,  # fp32: cap * log2(e) with SOFT_CAP (unused without)
    window,  # int32: positions attended back from the newest, inclusive
    head_dim,
    stride_qd,
    stride_qh,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    stride_od,
    stride_oh,
    stride_td,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,  # cache block size (a constant: divisions become shifts)
    BLOCK_G: tl.constexpr,  # >= GROUP, >= 16 (tl.dot's smallest tile)
    BLOCK_D: tl.constexpr,  # >= head_dim
    BLOCK_N: tl.constexpr,  # positions per tile
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # apply s = cap * tanh(s / cap) to every score
    SPLIT: tl.constexpr,  # program_id(2) picks a share of the tiles; partial results
    SINKS: tl.constexpr,  # each head's softmax has its sink logit in the denominator
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    start = tl.maximum(ctx - window, 0)
    n_lo = start // BLOCK_N * BLOCK_N
    n_hi = ctx
    if SPLIT:  # tiles [n_lo, ctx) dealt out in runs of `share`, run `split` here
        split = tl.program_id(2)
        share = tl.cdiv(tl.cdiv(ctx - n_lo, BLOCK_N), tl.num_programs(2)) * BLOCK_N
        n_lo = n_lo + split * share
        n_hi = tl.minimum(n_lo + share, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_q = (offs_g < GROUP)[:, None] & mask_d[None, :]
    heads = kv_head * GROUP + offs_g
    q_rows = q_ptr + seq.to(tl.int64) * stride_qd + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=mask_q, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]

    acc, l_i, m_i = _attend(
        q, k_ptr + kv_head.to(tl.int64) * stride_kh, v_ptr + kv_head.to(tl.int64) * stride_vh,
        tables_ptr + seq.to(tl.int64) * stride_td, start, ctx, n_lo, n_hi, qk_scale, cap_scale,
        stride_kt, stride_vt, offs_d, mask_d, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N,
        QK_PRECISION, PV_PRECISION, SOFT_CAP,
    )  # fmt: skip
    o_rows = out_ptr + seq.to(tl.int64) * stride_od + heads[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:  # an empty share (a short context) leaves l = 0: weight 0 in the merge
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        some = l_i > 0
        o = acc / tl.where(some, l_i, 1.0)[:, None]
        tl.store(o_rows + split * head_dim, o, mask=mask_q)
        lse = tl.where(some, m_i + tl.log2(tl.where(some, l_i, 1.0)), float("-inf"))
        rows = seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads  # (seq, head) in [D, H]
        tl.store(lse_ptr + rows * num_splits + split, lse, mask=offs_g < GROUP)
    else:
        if SINKS:  # the sink's share of the denominator, at the running max's scale
            sink = tl.load(sinks_ptr + heads, mask=offs_g < GROUP, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - m_i)
        o = acc / l_i[:, None]
        tl.store(o_rows, o.to(out_ptr.dtype.element_ty), mask=mask_q)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [D, H, S, hd] fp32: each split's normalised output
    lse_ptr,  # [D, H, S] fp32: each split's log2-sum-exp2, -inf for an empty split
    sinks_ptr,  # with SINKS, [H] fp32: each head's sink logit
    out_ptr,  # [D, H, hd]
    num_splits,
    head_dim,
    stride_od,
    stride_oh,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_D: tl.constexpr,  # >= head_dim
    SINKS: tl.constexpr,
):
    """out = sum_s w_s * part_s / sum_s w_s with w_s = 2^(lse_s - max lse): the softmax
    over every split's positions at once (with SINKS the head's sink adds
    2^(sink * log2(e) - max lse) to the denominator). Split 0 is never empty (its run
    starts at the tile of the first attended position), so the max is finite."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head  # (seq, head) in [D, H]
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(
        lse_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - top)  # [BLOCK_S], 0 for empty and padding splits
    mask = (offs_s < num_splits)[:, None] & (offs_d < head_dim)[None, :]
    parts = part_ptr + (row * num_splits + offs_s[:, None]) * head_dim + offs_d[None, :]
    part = tl.load(parts, mask=mask, other=0.0)  # [BLOCK_S, BLOCK_D]
    denominator = tl.sum(w, axis=0)
    if SINKS:
        denominator += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - top)
    o = tl.sum(part * w[:, None], axis=0) / denominator
    o_row = out_ptr + seq.to(tl.int64) * stride_od + head * stride_oh + offs_d
    tl.store(o_row, o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile configuration of _paged_decode_kernel (host ints only)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, min(64, 4096 // block_d))  # a [BLOCK_D, BLOCK_N] tile of <= 4096
    if dtype == torch.float32:
        qk, pv = "ieee", "ieee"
    else:
        qk, pv = "tf32", "tf32x3" if dtype == torch.float16 else "tf32"
    return dict(
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        QK_PRECISION=qk,
        PV_PRECISION=pv,
        num_warps=4,
    )


def paged_decode_attention(
    q: torch.Tensor,  # [D, H, hd]
    k_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    v_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    block_tables: torch.Tensor,  # [D, W] int32
    context_lens: torch.Tensor,  # [D] int32, 1 <= ctx <= W * block_size
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,  # > 0: Gemma 2's attention-logit soft cap
    out: torch.Tensor | None = None,  # [D, H, hd], q.dtype
    num_splits: int = 1,  # programs per (sequence, kv head), each over a share of the tiles
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [D, H, hd], q.dtype
    """See kernels.paged_decode_attention (arguments are checked there) and
    kernels.attention_reference. Reads no device value: the grid is (D, KVH,
    num_splits), host ints, and each program finds its share of its sequence's tiles
    from the context length on the device."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check_launch(
        "attention ops", _paged_decode_kernel, q, k_cache, v_cache, block_tables, context_lens, out
    )
    d, h, hd = q.shape
    kvh = k_cache.shape[0]
    if d == 0:
        return out
    window = _NO_WINDOW if sliding_window is None else min(sliding_window, _NO_WINDOW)
    if soft_cap is None:
        qk_scale, cap_scale = scale * _LOG2E, 1.0
    else:
        qk_scale, cap_scale = scale / soft_cap, soft_cap * _LOG2E
    cfg = decode_config(hd, h // kvh, q.dtype)
    split = num_splits > 1
    if split:  # each split's fp32 output and log-sum-exp, merged below
        dest = torch.empty((d, h, num_splits, hd), dtype=torch.float32, device=q.device)
        lse = torch.empty((d, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        dest, lse = out, out
    sink_arg = q if sinks is None else sinks  # a pointer the kernel never reads without
    _paged_decode_kernel[(d, kvh, num_splits)](
        q, k_cache, v_cache, dest, lse, sink_arg, block_tables, context_lens, qk_scale, cap_scale,
        window, hd, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), dest.stride(0), dest.stride(1),
        block_tables.stride(0), GROUP=h // kvh, BLOCK_SIZE=block_size,
        SOFT_CAP=soft_cap is not None, SPLIT=split, SINKS=sinks is not None, **cfg,
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(d, h)](
            dest, lse, sink_arg, out, num_splits, hd, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=cfg["BLOCK_D"],
            SINKS=sinks is not None,
        )  # fmt: skip
    return out
