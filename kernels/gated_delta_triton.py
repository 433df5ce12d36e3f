"""Triton Gated DeltaNet ops: CUDA, or CPU under TRITON_INTERPRET=1.

Imported lazily by `kernels.causal_conv1d` / `kernels.gated_delta_rule` when the triton
backend is chosen, so importing `kernels` never needs triton.

Every grid is sized from host ints only (the number of sequences, StateBatch.max_seq_len,
head counts and dims); each program loads its sequence's bounds, pool row and
initial-state flag itself, so no launcher reads a device value and a decode step has
the same launch whatever the values (CUDA-graph replayable). The pools are read and
written in place; a sequence without an initial state never reads its row (masked
loads, so a row holding NaN cannot leak in).

- _conv_kernel: one program per (sequence, block of its tokens, block of channels).
  Inputs before the sequence come from its conv state; the program of the first token
  block is the only one that reads that row, and it writes the row's new contents (the
  last K-1 inputs) after a barrier, so no program reads a row another has rewritten.
- _recurrent_kernel (decode batches): one program per (sequence, value head, block of
  dv), the state block [dk, BLOCK_V] in registers, one token at a time.
- _chunked_kernel (everything else): the same programs walking their sequence a chunk
  of BLOCK_T tokens at a time in the chunked form (see kernels.gated_delta_torch): the
  UT transform's inverse by forward substitution within 16-row blocks, merged by three
  dots, then six more tl.dot. A first, fused version: each dv block recomputes its
  chunk's T and every program runs its sequence alone (flash-linear-attention splits
  this across kernels and sequences); not yet measured on a GPU.

Dots run on fp32 tiles with input_precision tf32x3 (fp32-grade products on tensor
cores); the interpreter computes them in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_batch import StateBatch
from kernels.triton_launch import check_launch

_EPS = 1e-6  # the l2norm epsilon (kernels.gated_delta_reference.L2NORM_EPS)
_CHUNK = 64  # BLOCK_T of the chunked kernel: tokens per chunk
_PRECISION = "tf32x3"


@triton.jit
def _conv_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [D, K]
    bias_ptr,  # [D] (unused without HAS_BIAS)
    state_ptr,  # [num_slots, D, K-1]
    out_ptr,  # [T, D]
    cu_ptr,  # [N+1] int32
    slots_ptr,  # [N] int32
    init_ptr,  # [N] bool
    dim,
    stride_xt,
    stride_wd,
    stride_ss,
    stride_sd,
    stride_ot,
    KERNEL: tl.constexpr,
    STATE_PAD: tl.constexpr,  # >= KERNEL - 1, a power of two
    BLOCK_T: tl.constexpr,  # >= KERNEL, or 1 for decodes: only block 0 reads the state
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    seq = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    lo = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - lo
    if t0 >= length:
        return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(init_ptr + seq).to(tl.int32) != 0
    # positions before the sequence read the state only with one: pos < state_end, which
    # no position (>= 1 - K) is without (mask & scalar bool is wrong in the interpreter)
    state_end = tl.where(initial, 0, -KERNEL)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < length
    x_seq = x_ptr + lo.to(tl.int64) * stride_xt
    row = state_ptr + slot * stride_ss

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        pos = offs_t - (KERNEL - 1) + j  # the input tap j reads, relative to the sequence
        live = mask_t[:, None] & mask_d[None, :]
        xv = tl.load(
            x_seq + pos[:, None] * stride_xt + offs_d[None, :],
            mask=live & (pos >= 0)[:, None],
            other=0.0,
        )
        sv = tl.load(  # inputs before the sequence: its conv state (position K-1+pos)
            row + offs_d[None, :] * stride_sd + (KERNEL - 1 + pos)[:, None],
            mask=live & (pos < state_end)[:, None],
            other=0.0,
        )
        tap = tl.load(w_ptr + offs_d * stride_wd + j, mask=mask_d, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * tap[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out_rows = out_ptr + (lo + offs_t).to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])

    if t0 == 0:  # the new state: the last K-1 inputs, some still the old state's if short
        offs_s = tl.arange(0, STATE_PAD)
        pos = length - (KERNEL - 1) + offs_s
        live = (offs_s < KERNEL - 1)[None, :] & mask_d[:, None]
        xv = tl.load(
            x_seq + pos[None, :] * stride_xt + offs_d[:, None],
            mask=live & (pos >= 0)[None, :],
            other=0.0,
        )
        sv = tl.load(
            row + offs_d[:, None] * stride_sd + (KERNEL - 1 + pos)[None, :],
            mask=live & (pos < state_end)[None, :],
            other=0.0,
        )
        new = xv.to(tl.float32) + sv.to(tl.float32)  # [BLOCK_D, STATE_PAD]
        tl.debug_barrier()  # every read of the old row above is done
        tl.store(
            row + offs_d[:, None] * stride_sd + offs_s[None, :],
            new.to(state_ptr.dtype.element_ty),
            mask=live,
        )


@triton.jit
def _load_normalized(ptr, mask, scale, EPS: tl.constexpr, AXIS: tl.constexpr):
    """A q or k row ([BLOCK_K], AXIS 0) or rows ([BLOCK_T, BLOCK_K], AXIS 1) in fp32,
    l2-normalized along dk and scaled; masked entries are 0 (and stay 0)."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) + EPS)
    return x * (inv * scale)


@triton.jit
def _recurrent_kernel(
    q_ptr,  # [T, HK, dk]
    k_ptr,  # [T, HK, dk]
    v_ptr,  # [T, HV, dv]
    g_ptr,  # [T, HV]
    beta_ptr,  # [T, HV]
    state_ptr,  # [num_slots, HV, dk, dv] float32, contiguous
    out_ptr,  # [T, HV, dv]
    cu_ptr,  # [N+1] int32
    slots_ptr,  # [N] int32
    init_ptr,  # [N] bool
    dk,
    dv,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # value heads per key head
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EPS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // GROUP
    lo = tl.load(cu_ptr + seq)
    hi = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(init_ptr + seq).to(tl.int32) != 0
    offs_k = tl.arange(0, BLOCK_K)
    read_k = offs_k < tl.where(initial, dk, 0)  # the row is read only with a state
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    row = state_ptr + (slot * HV + head) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s = tl.load(row, mask=read_k[:, None] & mask_v[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]

    for i in range(0, hi - lo):
        t64 = lo.to(tl.int64) + i
        q = _load_normalized(q_ptr + t64 * stride_qt + kh * stride_qh + offs_k, mask_k, scale,
                             EPS, 0)  # fmt: skip
        k = _load_normalized(k_ptr + t64 * stride_kt + kh * stride_kh + offs_k, mask_k, 1.0,
                             EPS, 0)  # fmt: skip
        v = tl.load(v_ptr + t64 * stride_vt + head * stride_vh + offs_v, mask=mask_v, other=0.0)
        g = tl.load(g_ptr + t64 * stride_gt + head).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + head).to(tl.float32)
        s = s * tl.exp(g)
        delta = beta * (v.to(tl.float32) - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + head * stride_oh + offs_v,
                 o.to(out_ptr.dtype.element_ty), mask=mask_v)  # fmt: skip
    tl.store(row, s, mask=mask_s)


@triton.jit
def _unit_lower_inverse(a, offs_i, eye, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower [BLOCK_T, BLOCK_T] tile, BLOCK_T <= 64. The 16x16
    diagonal blocks by forward substitution, all four at once (row r of each block:
    T[r] = e_r - sum_{j<r} A[r, j] T[j], rows before r already final); then, with
    T_d that block-diagonal inverse and N = T_d A_off (A's blocks below the diagonal,
    so N⁴ = 0): (I + A)⁻¹ = (I + N)⁻¹ T_d = (I - N)(I + N²) T_d."""
    tl.static_assert(BLOCK_T <= 64)
    block = offs_i // 16
    within = block[:, None] == block[None, :]
    a_diag = tl.where(within, a, 0.0)
    inv = eye
    for r in range(1, 16):
        row = (offs_i % 16) == r
        step = tl.dot(tl.where(row[:, None], a_diag, 0.0), inv, input_precision=PRECISION)
        inv = tl.where(row[:, None], eye - step, inv)
    n = tl.dot(inv, tl.where(within, 0.0, a), input_precision=PRECISION)
    n2 = tl.dot(n, n, input_precision=PRECISION)
    return tl.dot(
        tl.dot(eye - n, eye + n2, input_precision=PRECISION), inv, input_precision=PRECISION
    )


@triton.jit
def _chunked_kernel(
    q_ptr,  # [T, HK, dk]
    k_ptr,  # [T, HK, dk]
    v_ptr,  # [T, HV, dv]
    g_ptr,  # [T, HV]
    beta_ptr,  # [T, HV]
    state_ptr,  # [num_slots, HV, dk, dv] float32, contiguous
    out_ptr,  # [T, HV, dv]
    cu_ptr,  # [N+1] int32
    slots_ptr,  # [N] int32
    init_ptr,  # [N] bool
    dk,
    dv,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per chunk
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EPS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // GROUP
    lo = tl.load(cu_ptr + seq)
    hi = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(init_ptr + seq).to(tl.int32) != 0
    offs_k = tl.arange(0, BLOCK_K)
    read_k = offs_k < tl.where(initial, dk, 0)  # the row is read only with a state
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_i = tl.arange(0, BLOCK_T)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    row = state_ptr + (slot * HV + head) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s = tl.load(row, mask=read_k[:, None] & mask_v[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]
    causal = offs_i[:, None] >= offs_i[None, :]  # [BLOCK_T, BLOCK_T]: j <= i
    eye = (offs_i[:, None] == offs_i[None, :]).to(tl.float32)

    for c0 in range(lo, hi, BLOCK_T):
        tok = c0 + offs_i
        mask_t = tok < hi
        t64 = tok.to(tl.int64)
        # padded rows load as zeros: k = v = β = g = 0 neither write nor decay the state
        q = _load_normalized(
            q_ptr + t64[:, None] * stride_qt + kh * stride_qh + offs_k[None, :],
            mask_t[:, None] & mask_k[None, :], scale, EPS, 1,
        )  # fmt: skip
        k = _load_normalized(
            k_ptr + t64[:, None] * stride_kt + kh * stride_kh + offs_k[None, :],
            mask_t[:, None] & mask_k[None, :], 1.0, EPS, 1,
        )  # fmt: skip
        v = tl.load(
            v_ptr + t64[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
            mask=mask_t[:, None] & mask_v[None, :],
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + head, mask=mask_t, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + head, mask=mask_t, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)  # [BLOCK_T]: log decay from the chunk's start
        gamma_end = tl.sum(g, axis=0)
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))

        kkt = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        a = tl.where(offs_i[:, None] > offs_i[None, :], kkt * decay * beta[:, None], 0.0)
        inv = _unit_lower_inverse(a, offs_i, eye, BLOCK_T, PRECISION)  # T = (I + A)⁻¹

        u = tl.dot(inv * beta[None, :], v, input_precision=PRECISION)  # [BLOCK_T, BLOCK_V]
        w = tl.dot(inv * (beta * tl.exp(gamma))[None, :], k, input_precision=PRECISION)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        o = tl.dot(q * tl.exp(gamma)[:, None], s, input_precision=PRECISION)
        o += tl.dot(attn, v_new, input_precision=PRECISION)
        tl.store(
            out_ptr + t64[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_v[None, :],
        )
        k_end = k * tl.exp(gamma_end - gamma)[:, None]
        s = s * tl.exp(gamma_end) + tl.dot(tl.trans(k_end), v_new, input_precision=PRECISION)
    tl.store(row, s, mask=mask_s)


def causal_conv1d(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [num_slots, D, K-1], x.dtype, contiguous
    batch: StateBatch,
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, D], x.dtype
    """See kernels.causal_conv1d (arguments are checked there). Reads no device value."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_launch("gated delta ops", _conv_kernel, x, weight, conv_state, out)
    t, dim = x.shape
    kernel = weight.shape[1]
    if t == 0:
        return out
    # a decode's one token per block; otherwise blocks of >= K tokens, so that only the
    # first block of a sequence reaches back into its conv state
    block_t = 1 if batch.is_decode else max(16, triton.next_power_of_2(kernel))
    block_d = 128
    grid = (batch.num_seqs, triton.cdiv(batch.max_seq_len, block_t), triton.cdiv(dim, block_d))
    _conv_kernel[grid](
        x, weight, weight if bias is None else bias, conv_state, out, batch.cu_seqlens,
        batch.state_slots, batch.has_initial_state, dim, x.stride(0), weight.stride(0),
        conv_state.stride(0), conv_state.stride(1), out.stride(0), KERNEL=kernel,
        STATE_PAD=triton.next_power_of_2(kernel - 1), BLOCK_T=block_t,
        BLOCK_D=block_d, HAS_BIAS=bias is not None, SILU=activation == "silu",
    )  # fmt: skip
    return out


def gated_delta_rule(
    q: torch.Tensor,  # [T, HK, dk]
    k: torch.Tensor,  # [T, HK, dk]
    v: torch.Tensor,  # [T, HV, dv]
    g: torch.Tensor,  # [T, HV]
    beta: torch.Tensor,  # [T, HV]
    recurrent_state: torch.Tensor,  # [num_slots, HV, dk, dv] float32, contiguous
    batch: StateBatch,
    out: torch.Tensor | None = None,  # [T, HV, dv], v.dtype
) -> torch.Tensor:  # [T, HV, dv], v.dtype
    """See kernels.gated_delta_rule (arguments are checked there). Reads no device value:
    a decode batch (one token per sequence) runs the recurrent kernel, anything else the
    chunked one."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    check_launch("gated delta ops", _chunked_kernel, q, k, v, g, beta, recurrent_state, out)
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if t == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(32, max(16, triton.next_power_of_2(dv)))
    grid = (batch.num_seqs, hv, triton.cdiv(dv, block_v))
    args = (
        q, k, v, g, beta, recurrent_state, out, batch.cu_seqlens, batch.state_slots,
        batch.has_initial_state, dk, dv, dk**-0.5, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), out.stride(0),
        out.stride(1),
    )  # fmt: skip
    common = dict(HV=hv, GROUP=hv // hk, BLOCK_K=block_k, BLOCK_V=block_v, EPS=_EPS)
    if batch.is_decode:
        _recurrent_kernel[grid](*args, **common)
    else:
        _chunked_kernel[grid](*args, **common, BLOCK_T=_CHUNK, PRECISION=_PRECISION)
    return out
