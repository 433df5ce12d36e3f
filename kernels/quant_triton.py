"""Triton dequantizing GEMMs for packed weights: CUDA, or CPU under TRITON_INTERPRET=1.

Imported lazily by `kernels.quant_linear` / `kernels.quant_moe_gemm` when the triton
backend is chosen. One kernel for every format: a program owns a [BLOCK_M, BLOCK_N]
tile of the output (of one expert's sorted rows for MoE: the grid is (E, row blocks,
column blocks), sized from host ints only, as kernels.moe_triton). Each K step loads the
packed codes of a [BLOCK_K, BLOCK_N] tile of Wᵀ, decodes them in registers (a
`_*_tile` function per format, chosen by the FMT constexpr) and feeds tl.dot; W is never
written dense anywhere.

Scales: when one scale covers the whole K step for each column (FP8 blocks or INT4
groups that are multiples of BLOCK_K, per-channel, per-tensor), the tile's codes go to
tl.dot as they are and the scale multiplies the [BLOCK_M, BLOCK_N] partial product
(SCALE_AFTER); otherwise (desc_act g_idx, small groups, MXFP4's 32, NF4) every element
is scaled before the dot.

The dot: on CUDA, fp16/bf16 activations meet the decoded tile in their own dtype
(tensor cores, fp32 accumulation: W rounded into x's dtype, as the torch path does);
fp32 activations, and everything under the interpreter (whose bf16 dot is wrong in
triton 3.9), widen both to fp32. FP8 weights are read as bytes and decoded by integer
ops (exact, and runs where the GPU has no fp8 type); W8A8 (act_fp8, sm89+) feeds fp8 x
fp8 to the dot and applies the per-token scale on the way out.

Decode GEMVs split K (_split_k) so that a one-row-block grid still fills the SMs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.moe_plan import ExpertPlan
from kernels.quant_formats import (
    E2M1_VALUES,
    AwqInt4,
    Fp8Weight,
    GptqInt4,
    Mxfp4Weight,
    Nf4Weight,
    PackQuantizedInt4,
    QuantizedWeight,
)
from kernels.triton_launch import check_launch

FP8, INT4, MXFP4, NF4 = 0, 1, 2, 3
ZERO_CONST8, ZERO_PACKED, ZERO_PACKED_PLUS1 = 0, 1, 2


@triton.jit
def _fp8_tile(
    w_ptr, s_ptr, offs_k, offs_n, k0, mask, mask_n, s_wn, s_wk, s_sn, s_sk,
    BN: tl.constexpr, BK: tl.constexpr, SCALE_AFTER: tl.constexpr, ACT_FP8: tl.constexpr,
):  # fmt: skip
    """The e4m3 bytes (read as uint8: no fp8 type needed before sm89) of a [BLOCK_K,
    BLOCK_N] tile of Wᵀ, decoded to fp16 holding value / 256 (the 256 goes into the
    scale), or as fp8 for the W8A8 dot."""
    b = tl.load(w_ptr + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk, mask=mask, other=0)
    if SCALE_AFTER:
        s = tl.load(s_ptr + (offs_n // BN) * s_sn + (k0 // BK) * s_sk, mask=mask_n, other=0.0)
        if ACT_FP8:
            return b.to(tl.float8e4nv, bitcast=True), s
        return _e4m3_over_256(b), s * 256.0
    s_tile = tl.load(
        s_ptr + (offs_n[None, :] // BN) * s_sn + (offs_k[:, None] // BK) * s_sk,
        mask=mask, other=0.0,
    )  # fmt: skip
    return _e4m3_over_256(b).to(tl.float32) * (s_tile * 256.0), s_tile


@triton.jit
def _e4m3_over_256(b):
    """uint8 e4m3 bits -> fp16 value / 256, exactly: kernels.quant_formats.e4m3_over_256."""
    h = b.to(tl.int16)
    return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _int4_tile(
    w_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, k0, mask, mask_n, K,
    s_wk, s_wn, s_sg, s_sn, s_zg, s_zn,
    GROUP: tl.constexpr, ALONG_N: tl.constexpr, AWQ: tl.constexpr, ZERO: tl.constexpr,
    HAS_GIDX: tl.constexpr, SCALE_AFTER: tl.constexpr,
):  # fmt: skip
    k = offs_k[:, None]
    n = offs_n[None, :]
    if ALONG_N:  # AWQ: word [k, n // 8], column n % 8 at nibble AWQ_INVERSE_ORDER[n % 8]
        word = tl.load(w_ptr + k * s_wk + (n // 8) * s_wn, mask=mask, other=0)
        pos = _nibble_of_column(n % 8, AWQ)
    else:  # compressed-tensors word [n, k // 8], GPTQ word [k // 8, n]: nibble k % 8
        word = tl.load(w_ptr + (k // 8) * s_wk + n * s_wn, mask=mask, other=0)
        pos = k % 8
    u = (word >> (pos * 4)) & 0xF
    if SCALE_AFTER:  # one group over this K step: [BLOCK_N] scales and zeros
        g = k0 // GROUP
        s = tl.load(s_ptr + g * s_sg + offs_n * s_sn, mask=mask_n, other=0.0).to(tl.float32)
        z = _zeros(z_ptr, g, offs_n, mask_n, s_zg, s_zn, AWQ, ZERO)
        return (u - z[None, :]).to(tl.float32), s
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)[:, None]
    else:
        g = k // GROUP
    s = tl.load(s_ptr + g * s_sg + n * s_sn, mask=mask, other=0.0).to(tl.float32)
    z = _zeros(z_ptr, g, n, mask, s_zg, s_zn, AWQ, ZERO)
    return (u - z).to(tl.float32) * s, s


@triton.jit
def _nibble_of_column(c, AWQ: tl.constexpr):
    if AWQ:  # AWQ_INVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
        return (c % 2) * 4 + c // 2
    return c


@triton.jit
def _zeros(z_ptr, g, n, mask, s_zg, s_zn, AWQ: tl.constexpr, ZERO: tl.constexpr):
    """Zero points of groups g at columns n, packed 8 per int32 along N."""
    if ZERO == 0:
        return tl.full(n.shape, 8, tl.int32) + 0 * g
    word = tl.load(z_ptr + g * s_zg + (n // 8) * s_zn, mask=mask, other=0)
    z = (word >> (_nibble_of_column(n % 8, AWQ) * 4)) & 0xF
    if ZERO == 2:  # GPTQ v1 stores zero - 1
        z += 1
    return z


@triton.jit
def _mxfp4_tile(
    b_ptr, s_ptr, lut_ptr, offs_k, offs_n, mask, s_bn, s_bk, s_sn, s_sk,
):  # fmt: skip
    k = offs_k[:, None]
    n = offs_n[None, :]
    byte = tl.load(b_ptr + n * s_bn + (k // 32) * s_bk + (k % 32) // 2, mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((k % 2) * 4)) & 0xF
    e = tl.load(s_ptr + n * s_sn + (k // 32) * s_sk, mask=mask, other=127).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)  # e8m0: 2 ** (e - 127), built exactly
    return tl.load(lut_ptr + code) * scale


@triton.jit
def _nf4_tile(p_ptr, a_ptr, lut_ptr, offs_k, offs_n, mask, K, BLOCKSIZE: tl.constexpr):
    i = offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # flat row-major index
    byte = tl.load(p_ptr + i // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((1 - i % 2) * 4).to(tl.int32)) & 0xF  # element 2j in the high nibble
    a = tl.load(a_ptr + i // BLOCKSIZE, mask=mask, other=0.0)
    return tl.load(lut_ptr + code) * a


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K]: activations (fp8 with ACT_FP8), rows sorted by expert when GROUPED
    out_ptr,  # [M, N], or [SPLIT_K, M, N] fp32 partial sums
    bias_ptr,  # [N] or a dummy
    indptr_ptr,  # [E+1] int32 when GROUPED
    xs_ptr,  # [M] fp32 per-token activation scales when ACT_FP8
    w_ptr, s_ptr, z_ptr, g_ptr, lut_ptr,  # the format's tensors (dummies where unused)
    M, N, K,
    stride_xm, stride_om, stride_os,  # x rows, out rows, out splits
    K_SPLIT,  # K per split (a multiple of BLOCK_K)
    s_we, s_w0, s_w1,  # per-expert stride of w, then its two strides (meaning per FMT)
    s_se, s_s0, s_s1,
    s_ze, s_z0, s_z1,
    s_ge,
    FMT: tl.constexpr,
    P0: tl.constexpr,  # FP8 block rows / INT4 group / NF4 blocksize
    P1: tl.constexpr,  # FP8 block cols
    ALONG_N: tl.constexpr, AWQ: tl.constexpr, ZERO: tl.constexpr, HAS_GIDX: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    if GROUPED:
        end = tl.load(indptr_ptr + e + 1)
        m0 = tl.load(indptr_ptr + e) + pid_m * BLOCK_M
    else:
        end = M
        m0 = pid_m * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_n = offs_n < N
    e64 = e.to(tl.int64)
    w_ptr += e64 * s_we
    s_ptr += e64 * s_se
    z_ptr += e64 * s_ze
    g_ptr += e64 * s_ge
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, tl.minimum(K, k_start + K_SPLIT), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_k[:, None] & mask_n[None, :]
        xk = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FMT == 0:
            wt, s = _fp8_tile(
                w_ptr, s_ptr, offs_k, offs_n, k0, mask, mask_n, s_w0, s_w1, s_s0, s_s1,
                P0, P1, SCALE_AFTER, ACT_FP8,
            )  # fmt: skip
        elif FMT == 1:
            wt, s = _int4_tile(
                w_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, k0, mask, mask_n, K,
                s_w0, s_w1, s_s0, s_s1, s_z0, s_z1, P0, ALONG_N, AWQ, ZERO, HAS_GIDX,
                SCALE_AFTER,
            )  # fmt: skip
        elif FMT == 2:
            wt = _mxfp4_tile(w_ptr, s_ptr, lut_ptr, offs_k, offs_n, mask, s_w0, s_w1, s_s0, s_s1)
            s = wt
        else:
            wt = _nf4_tile(w_ptr, s_ptr, lut_ptr, offs_k, offs_n, mask, K, P0)
            s = wt
        if DOT_F32:
            part = tl.dot(xk.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xk, wt.to(x_ptr.dtype.element_ty))
        if SCALE_AFTER:
            acc += part * s[None, :]
        else:
            acc += part
    if ACT_FP8:
        acc *= tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def quant_linear(
    x: torch.Tensor,  # [M, K], unit stride along K
    w: QuantizedWeight,  # one matrix W [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act_fp8: bool = False,
    split_k: int | None = None,  # None: _split_k's choice
) -> torch.Tensor:  # [M, N], x.dtype
    m = x.shape[0]
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _launch(x, w, out, bias, None, (1, m), act_fp8, split_k)
    return out


def quant_moe_gemm(
    x: torch.Tensor,  # [P, K], rows sorted by expert
    w: QuantizedWeight,  # stacked experts W [E, N, K]
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _launch(x, w, out, None, plan.expert_indptr, (plan.num_experts, plan.max_rows), False, 1)
    return out


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] float8_e4m3fn, scale [M] float32) with x ~ x_q * scale[:, None]:
    dynamic per-token activation scales, amax / 448 per row."""
    scale = (x.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (x.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def _launch(
    x: torch.Tensor,
    w: QuantizedWeight,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    indptr: torch.Tensor | None,
    rows: tuple[int, int],  # (programs along dim 0: experts, most rows one of them has)
    act_fp8: bool,
    split_k: int | None,
) -> None:
    check_launch("quantized GEMMs", _quant_gemm_kernel, x, out)
    m, k = x.shape
    n = w.shape[0]
    block_m = 16 if rows[1] <= 16 else 64
    block_n, block_k = 64, 64
    fmt = _format_args(w, block_k)
    xs = None
    if act_fp8:
        if not fmt.scale_after:
            raise ValueError(f"quant_linear: act_fp8 needs FP8 blocks of {block_k}-multiples")
        if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
            raise ValueError("quant_linear: act_fp8 needs an fp8 tensor-core GPU (sm89+)")
        x, xs = per_token_fp8(x)
    tiles = (rows[0], triton.cdiv(rows[1], block_m), triton.cdiv(n, block_n))
    split = split_k or _split_k(tiles[0] * tiles[1] * tiles[2], k, block_k, x.device)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    # split K: partial sums [split, M, N] summed by torch (in a fixed order: deterministic)
    target = out if split == 1 else torch.empty(split, m, n, device=x.device)
    dummy = out
    _quant_gemm_kernel[(tiles[0], tiles[1], tiles[2] * split)](
        x, target, dummy if bias is None else bias, dummy if indptr is None else indptr,
        dummy if xs is None else xs,
        *fmt.tensors, m, n, k, x.stride(0), target.stride(-2),
        0 if split == 1 else target.stride(0), k_split, *fmt.strides,
        FMT=fmt.kind, P0=fmt.p0, P1=fmt.p1, ALONG_N=fmt.along_n, AWQ=fmt.awq, ZERO=fmt.zero,
        HAS_GIDX=fmt.has_gidx, SCALE_AFTER=fmt.scale_after,
        GROUPED=indptr is not None, HAS_BIAS=bias is not None, ACT_FP8=act_fp8,
        DOT_F32=not x.is_cuda or x.dtype == torch.float32,
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    if split > 1:
        out.copy_(target.sum(dim=0))


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """K splits for a launch of `programs` output tiles: on CUDA, doubled while the grid
    stays within two programs per SM and each split keeps >= 4 K steps (a decode GEMV
    has one row block: N / BLOCK_N programs alone leave most of the SMs idle). Untuned:
    a first guess for the GPU session's measurements. 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index or 0)
    split = 1
    while split < 16 and programs * split * 2 <= 2 * sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class _FormatArgs:
    """The kernel's view of one packed weight: tensors, strides, constexprs."""

    def __init__(self, kind, tensors, strides, p0=1, p1=1, along_n=False, awq=False,
                 zero=ZERO_CONST8, has_gidx=False, scale_after=False):  # fmt: skip
        self.kind, self.tensors, self.strides = kind, tensors, strides
        self.p0, self.p1, self.along_n, self.awq = p0, p1, along_n, awq
        self.zero, self.has_gidx, self.scale_after = zero, has_gidx, scale_after


def _strides(t: torch.Tensor | None, stacked: bool) -> list[int]:
    """[expert stride, stride 0, stride 1] of a matrix or stacked-experts tensor."""
    if t is None:
        return [0, 0, 0]
    if stacked:
        return [t.stride(0), t.stride(-2), t.stride(-1)]
    return [0, t.stride(-2), t.stride(-1)]


def _format_args(w: QuantizedWeight, block_k: int) -> _FormatArgs:
    stacked = w.num_experts is not None
    n, k = w.shape
    if isinstance(w, Fp8Weight):
        bn, bk = w.block
        after = bk % block_k == 0 or bk >= k
        strides = _strides(w.weight, stacked) + _strides(w.scale, stacked) + [0, 0, 0, 0]
        tensors = (w.weight.view(torch.uint8), w.scale, w.scale, w.scale, w.scale)
        return _FormatArgs(FP8, tensors, strides, p0=bn, p1=bk, scale_after=after)
    if isinstance(w, PackQuantizedInt4 | GptqInt4 | AwqInt4):
        return _int4_args(w, stacked, block_k)
    if isinstance(w, Mxfp4Weight):
        if w.blocks.stride(-1) != 1:
            raise ValueError("quant_linear: Mxfp4Weight blocks need unit stride along a block")
        lut = torch.tensor(E2M1_VALUES, device=w.device)
        bs = [w.blocks.stride(0) if stacked else 0, w.blocks.stride(-3), w.blocks.stride(-2)]
        strides = bs + _strides(w.scales, stacked) + [0, 0, 0, 0]
        return _FormatArgs(MXFP4, (w.blocks, w.scales, lut, lut, lut), strides)
    if isinstance(w, Nf4Weight):
        if not (w.packed.is_contiguous() and w.absmax.is_contiguous()):
            raise ValueError("quant_linear: Nf4Weight packed and absmax must be contiguous")
        strides = [0] * 10
        tensors = (w.packed, w.absmax, w.code, w.code, w.code)
        return _FormatArgs(NF4, tensors, strides, p0=w.blocksize)
    raise TypeError(f"no Triton kernel for {type(w).__name__}")


def _int4_args(w: PackQuantizedInt4 | GptqInt4 | AwqInt4, stacked: bool, block_k: int):
    k = w.shape[1]
    if isinstance(w, PackQuantizedInt4):  # word [n, k//8]; zeros [n//8, g]; scales [n, g]
        wt, sc, zp, gi = w.weight_packed, w.weight_scale, w.weight_zero_point, None
        ws = _swap(_strides(wt, stacked))
        ss = _swap(_strides(sc, stacked))
        zs = _swap(_strides(zp, stacked))
        zero = ZERO_CONST8 if zp is None else ZERO_PACKED
        along_n = awq = False
    else:  # GPTQ word [k//8, n] / AWQ word [k, n//8]; zeros [g, n//8]; scales [g, n]
        wt, sc, zp = w.qweight, w.scales, w.qzeros
        gi = getattr(w, "g_idx", None)
        ws, ss, zs = _strides(wt, stacked), _strides(sc, stacked), _strides(zp, stacked)
        along_n = awq = isinstance(w, AwqInt4)
        zero = ZERO_PACKED if awq else ZERO_PACKED_PLUS1
    group = w.group_size
    after = gi is None and (group % block_k == 0 or group >= k)
    gs = [gi.stride(0) if (gi is not None and stacked) else 0]
    tensors = (wt, sc, wt if zp is None else zp, wt if gi is None else gi, wt)
    return _FormatArgs(
        INT4, tensors, ws + ss + zs + gs, p0=group, along_n=along_n, awq=awq, zero=zero,
        has_gidx=gi is not None, scale_after=after,
    )  # fmt: skip


def _swap(s: list[int]) -> list[int]:
    """[expert, stride over n, stride over k] -> [expert, over k, over n]: the kernel's
    order (k-like axis first) for tensors stored n-major."""
    return [s[0], s[2], s[1]]
