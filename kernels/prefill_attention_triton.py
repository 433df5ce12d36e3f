"""Prefill attention on CUDA (or CPU under TRITON_INTERPRET=1): SDPA's flash kernel where
it applies, this module's Triton kernel for the rest.

Imported lazily by `kernels.prefill_attention` when the triton backend is chosen.

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
precisions as in kernels.paged_attention_triton (tiles widened to fp32).
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

from kernels.paged_attention_triton import _check_launch, _tanh

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
    kernels.prefill_attention_reference."""
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
    _check_launch(q, k, v, out)
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
