"""Dense weight -> packed quantized weight, by each format's spec: what tests build their
weights with (and what a converter would use). The reverse is kernels.quant_formats'
`dequantize`; `nf4_absmax` undoes bitsandbytes' double quantization of the absmax at load.

Every quantizer takes W [N, K] (out, in) in any float dtype and rounds to nearest.
"""

from __future__ import annotations

import torch

from kernels.quant_formats import (
    AWQ_ORDER,
    E2M1_VALUES,
    FP8_MAX,
    NF4_VALUES,
    AwqInt4,
    Fp8Weight,
    GptqInt4,
    Mxfp4Weight,
    Nf4Weight,
    PackQuantizedInt4,
)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = (128, 128)) -> Fp8Weight:
    """E4M3 codes with scale = amax / 448 per (bn x bk) tile; block None: per tensor,
    (1, K): per channel."""
    n, k = w.shape
    bn, bk = block or (n, k)
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float()
    tiles = padded.view(gn, bn, gk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [gn, gk]
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale, (bn, bk))


def quantize_int4(
    w: torch.Tensor, groups: torch.Tensor, num_groups: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] uint8 in [0, 15], scales [N, G] float32, zeros [N, G] uint8) with
    W[n, k] ~ (codes - zeros) * scales over each group g = groups[k]. Symmetric: zero 8,
    scale = amax / 7.5 (codes clamp to [0, 15]); asymmetric: scale = (max - min) / 15."""
    n, _ = w.shape
    w = w.float()
    lo = torch.full((n, num_groups), float("inf")).scatter_reduce(
        1, groups.expand(n, -1), w, "amin"
    )
    hi = torch.full((n, num_groups), float("-inf")).scatter_reduce(
        1, groups.expand(n, -1), w, "amax"
    )
    if symmetric:
        scales = (torch.maximum(hi.abs(), lo.abs()) / 7.5).clamp(min=1e-8)
        zeros = torch.full((n, num_groups), 8, dtype=torch.uint8)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = (-lo / scales).round().clamp(0, 15).to(torch.uint8)
    s, z = scales.index_select(1, groups), zeros.index_select(1, groups).float()
    codes = (w / s + z).round().clamp(0, 15).to(torch.uint8)
    return codes, scales, zeros


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[R, 8*C] codes in [0, 15] -> [R, C] int32, code j of each 8 in bits 4j..4j+3."""
    r, c8 = u.shape
    pairs = u.to(torch.uint8).reshape(r, c8 // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)


def pack_quantized(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> PackQuantizedInt4:
    """compressed-tensors pack-quantized from quantize_int4's output (zeros None:
    symmetric, where every zero must be 8)."""
    n, k = codes.shape
    padded = torch.zeros(n, -(-k // 8) * 8, dtype=torch.uint8)
    padded[:, :k] = codes
    zp = None
    if zeros is not None:
        zpad = torch.zeros(-(-n // 8) * 8, zeros.shape[1], dtype=torch.uint8)
        zpad[:n] = zeros
        zp = pack_nibbles(zpad.t().contiguous()).t().contiguous()  # along N
    return PackQuantizedInt4(pack_nibbles(padded), scales.to(scale_dtype), zp, (n, k), group_size)


def pack_gptq(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> GptqInt4:
    """GPTQ v1 from quantize_int4's output: codes along K, zeros - 1 along N."""
    qweight = pack_nibbles(codes.contiguous()).t().contiguous()  # [K/8, N]: along K
    qzeros = pack_nibbles(((zeros.int() - 1) & 0xF).t().contiguous())  # [G, N/8]
    gi = None if g_idx is None else g_idx.to(torch.int32)
    return GptqInt4(qweight, qzeros, scales.t().to(scale_dtype).contiguous(), gi, group_size)


def pack_awq(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
) -> AwqInt4:
    """AutoAWQ GEMM from quantize_int4's output: codes and zeros along N, each 8 columns
    in AWQ_ORDER."""

    def along_n(u: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        r, n = u.shape
        return pack_nibbles(u.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n))

    qweight = along_n(codes.t().contiguous())
    return AwqInt4(qweight, along_n(zeros.t().contiguous()), scales.t().to(scale_dtype), group_size)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """OCP MX: per 32 elements along K the shared exponent floor(log2(amax)) - 2 (e2m1's
    largest exponent), each element rounded to the nearest e2m1 value (clamped at 6)."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    values = torch.tensor(E2M1_VALUES)
    codes = (scaled[..., None] - values).abs().argmin(dim=-1).to(torch.uint8)  # [n, K/32, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Mxfp4Weight(packed.contiguous(), (exp + 127).to(torch.uint8))


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> Nf4Weight:
    """bitsandbytes NF4: absmax per `blocksize` flat elements, the nearest NF4 code,
    two codes per byte, the first in the high nibble."""
    n, k = w.shape
    flat = w.float().reshape(-1)
    nblocks = -(-flat.numel() // blocksize)
    padded = torch.zeros(nblocks * blocksize)
    padded[: flat.numel()] = flat
    absmax = padded.view(nblocks, blocksize).abs().amax(dim=1).clamp(min=1e-12)
    scaled = (padded.view(nblocks, blocksize) / absmax[:, None]).reshape(-1)[: flat.numel()]
    code = torch.tensor(NF4_VALUES)
    codes = (scaled[:, None] - code).abs().argmin(dim=1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = (codes[0::2] << 4) | codes[1::2]
    return Nf4Weight(packed, absmax, code, (n, k), blocksize)


def nf4_absmax(
    absmax: torch.Tensor,  # [B] uint8: the checkpoint's `absmax` under double quantization
    nested_absmax: torch.Tensor,  # [ceil(B / nested_blocksize)] float32
    nested_quant_map: torch.Tensor,  # [256] float32: the 8-bit dynamic code
    offset: float,  # quant_state's `nested_offset`
    nested_blocksize: int = 256,
) -> torch.Tensor:  # [B] float32
    """bitsandbytes' double-quantized absmax back in fp32, what Nf4Weight holds:
    absmax[i] = nested_quant_map[code_i] * nested_absmax[i // nested_blocksize] + offset."""
    idx = torch.arange(absmax.shape[0], device=absmax.device) // nested_blocksize
    values = nested_quant_map.float()[absmax.long()] * nested_absmax.float()[idx]
    return values + offset
