"""Packed quantized weights, one frozen dataclass per checkpoint format, each holding the
tensors as the Hub and llm-compressor write them (device bytes = checkpoint bytes), and
`dequantize`: the obviously-correct oracle every quantized GEMM is tested against.

A weight W is [N, K] (out, in), or [E, N, K] for stacked experts: every tensor then has
a leading E dim (`stack_experts`). Each format's `dequantize_rows(n0, n1, expert)` returns
rows n0:n1 of W in float32, written straight from the format's published layout; the
CPU GEMM (kernels.quant_torch) runs it per tile of rows, so the reference and the torch
path share it, and the Triton kernels (kernels.quant_triton) read the same tensors.

INT4 codes are unsigned nibbles u in [0, 15] everywhere below: value = (u - z) * s with
z the zero point (8 for symmetric schemes). Nibble tricks assume a little-endian host
(the int32 words are read as bytes, low byte first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# OCP MX e2m1 code -> value (sign bit 3, then 2 exponent bits and 1 mantissa bit)
E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# bitsandbytes' NF4 code -> value: the 16 quantiles of N(0, 1) scaled into [-1, 1]
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


class _Packed:
    """What every format shares: shape, experts, bytes, device."""

    shape: tuple[int, int]  # (N, K) of one matrix

    @property
    def num_experts(self) -> int | None:
        """E for stacked experts, None for one matrix."""
        lead = self._lead_tensor()
        return lead.shape[0] if lead.dim() == self._matrix_dims + 1 else None

    @property
    def nbytes(self) -> int:
        """Device bytes of the packed form: every tensor field."""
        return sum(t.numel() * t.element_size() for t in _tensor_fields(self))

    @property
    def device(self) -> torch.device:
        return self._lead_tensor().device

    def _lead_tensor(self) -> torch.Tensor:
        return getattr(self, dataclasses.fields(self)[0].name)

    _matrix_dims = 2

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _at(self, t: torch.Tensor | None, expert: int | None) -> torch.Tensor | None:
        """One expert's slice of a stacked field (t itself for one matrix)."""
        if t is None or expert is None:
            return t
        return t[expert]


@dataclass(frozen=True)
class Fp8Weight(_Packed):
    """FP8 E4M3 with one fp32 scale per (bn x bk) tile of W: W[n, k] = weight[n, k] *
    scale[n // bn, k // bk]. Block-wise 128x128 (Qwen/DeepSeek `weight_scale_inv`,
    block=(128, 128)), compressed-tensors float-quantized per-channel (`weight_scale`
    [N, 1], block=(1, K)) and per-tensor ([1] -> [1, 1], block=(N, K)) are all this.
    Activation scales are not part of the weight (W8A16; quant_linear's act_fp8 computes
    dynamic per-token ones); `dynamic_activations` says the checkpoint was made to run
    so (W8A8), where the hardware can."""

    weight: torch.Tensor  # [(E,) N, K] float8_e4m3fn
    scale: torch.Tensor  # [(E,) ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int]  # (bn, bk)
    dynamic_activations: bool = False

    def __post_init__(self) -> None:
        n, k = self.weight.shape[-2:]
        bn, bk = self.block
        want = (-(-n // bn), -(-k // bk))
        if self.weight.dtype != torch.float8_e4m3fn or tuple(self.scale.shape[-2:]) != want:
            raise ValueError(
                f"Fp8Weight: weight {self.weight.dtype} {tuple(self.weight.shape)} must be "
                f"float8_e4m3fn, scale {tuple(self.scale.shape)} [..., {want[0]}, {want[1]}]"
            )
        if self.scale.dtype != torch.float32 or self.scale.shape[:-2] != self.weight.shape[:-2]:
            raise ValueError(f"Fp8Weight: scale {self.scale.dtype} must be float32, per expert")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape[-2:])

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        w, s = self._at(self.weight, expert)[n0:n1], self._at(self.scale, expert)
        bn, bk = self.block
        rows = torch.arange(n0, n1, device=w.device) // bn
        scale = s.index_select(0, rows) * 256.0  # [n, ceil(K/bk)]; 256: see e4m3_over_256
        return _scaled_groups(e4m3_over_256(w).float(), scale, None, bk)


@dataclass(frozen=True)
class PackQuantizedInt4(_Packed):
    """compressed-tensors `pack-quantized`, 4 bits, group (or channel: group_size = K)
    strategy. weight_packed holds 8 codes per int32 along K, code j of a word in bits
    4j..4j+3; codes carry the +8 offset (u = q + 8). Asymmetric schemes add
    weight_zero_point, its signed zeros offset by 8 the same way and packed 8 per int32
    along N. W[n, k] = (u[n, k] - z[n, g]) * weight_scale[n, g], g = k // group_size,
    z = 8 when symmetric."""

    weight_packed: torch.Tensor  # [(E,) N, ceil(K/8)] int32
    weight_scale: torch.Tensor  # [(E,) N, ceil(K/group_size)] float16/bfloat16/float32
    weight_zero_point: torch.Tensor | None  # [(E,) ceil(N/8), ceil(K/group_size)] int32
    shape: tuple[int, int]  # (N, K): the checkpoint's weight_shape
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.shape
        g = -(-k // self.group_size)
        ok = (
            self.weight_packed.dtype == torch.int32
            and tuple(self.weight_packed.shape[-2:]) == (n, -(-k // 8))
            and tuple(self.weight_scale.shape[-2:]) == (n, g)
        )
        zp = self.weight_zero_point
        if not ok or (zp is not None and tuple(zp.shape[-2:]) != (-(-n // 8), g)):
            raise ValueError(
                f"PackQuantizedInt4 {self.shape} group {self.group_size}: weight_packed "
                f"{tuple(self.weight_packed.shape)} must be int32 [..., {n}, {-(-k // 8)}], "
                f"weight_scale {tuple(self.weight_scale.shape)} [..., {n}, {g}], zero point "
                f"{None if zp is None else tuple(zp.shape)} [..., {-(-n // 8)}, {g}]"
            )

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        n, k = self.shape
        u = unpack_nibbles(self._at(self.weight_packed, expert)[n0:n1])[:, :k]  # [n, K]
        scale = self._at(self.weight_scale, expert)[n0:n1].float()  # [n, G]
        zp = self._at(self.weight_zero_point, expert)
        if zp is None:
            return _scaled_groups(u.float() - 8, scale, None, self.group_size)
        _check_aligned(n0, n1, n, 8, "PackQuantizedInt4 zero points")
        z = unpack_nibbles(zp[n0 // 8 : -(-n1 // 8)].t()).t()[: n1 - n0]  # [n, G]
        return _scaled_groups(u.float(), scale, z.float(), self.group_size)


@dataclass(frozen=True)
class GptqInt4(_Packed):
    """GPTQ 4-bit, the auto-gptq / gptqmodel v1 checkpoint (`quant_method: gptq`,
    `checkpoint_format: gptq`): qweight holds 8 codes per int32 along K (code j of a
    word in bits 4j..), qzeros 8 per int32 along N, stored as zero - 1 (v1's offset).
    W[n, k] = (u[k, n] - (qz[g, n] + 1)) * scales[g, n], g = g_idx[k]; without
    `desc_act` g_idx[k] = k // group_size, with it any map (then pass g_idx)."""

    qweight: torch.Tensor  # [(E,) K/8, N] int32
    qzeros: torch.Tensor  # [(E,) G, N/8] int32
    scales: torch.Tensor  # [(E,) G, N] float16/bfloat16/float32
    g_idx: torch.Tensor | None  # [(E,) K] int32 group of each input row; None: k // group
    group_size: int  # the checkpoint's; K for group_size -1

    def __post_init__(self) -> None:
        k8, n = self.qweight.shape[-2:]
        g = self.scales.shape[-2]
        ok = (
            self.qweight.dtype == torch.int32 and self.qzeros.dtype == torch.int32
            and n % 8 == 0 and tuple(self.qzeros.shape[-2:]) == (g, n // 8)
            and self.scales.shape[-1] == n
            and (self.g_idx is not None or g == -(-k8 * 8 // self.group_size))
        )  # fmt: skip
        if not ok or (self.g_idx is not None and self.g_idx.shape[-1] != k8 * 8):
            raise ValueError(
                f"GptqInt4: qweight {tuple(self.qweight.shape)} [K/8, N] (N % 8 == 0), qzeros "
                f"{tuple(self.qzeros.shape)} [G, N/8] int32, scales {tuple(self.scales.shape)} "
                f"[G, N], g_idx {None if self.g_idx is None else tuple(self.g_idx.shape)} [K]"
            )

    @property
    def shape(self) -> tuple[int, int]:
        k8, n = self.qweight.shape[-2:]
        return (n, k8 * 8)

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        _check_aligned(n0, n1, self.shape[0], 8, "GptqInt4 zeros")
        u = unpack_nibbles(self._at(self.qweight, expert)[:, n0:n1].t())  # [n, K]
        z = unpack_nibbles(self._at(self.qzeros, expert)[:, n0 // 8 : n1 // 8]) + 1  # [G, n]
        s = self._at(self.scales, expert)[:, n0:n1].float()  # [G, n]
        g_idx = self._at(self.g_idx, expert)
        return _scaled_groups(u.float(), s.t(), z.t().float(), self.group_size, g_idx)


@dataclass(frozen=True)
class AwqInt4(_Packed):
    """AutoAWQ GEMM 4-bit (`quant_method: awq`, `version: gemm`): qweight holds 8 codes
    per int32 along N in AWQ's interleaved order (bits 4j.. of a word hold column
    AWQ_ORDER[j] = (0, 2, 4, 6, 1, 3, 5, 7)[j] of its 8), qzeros likewise, no offset.
    W[n, k] = (u[k, n] - z[g, n]) * scales[g, n], g = k // group_size."""

    qweight: torch.Tensor  # [(E,) K, N/8] int32
    qzeros: torch.Tensor  # [(E,) K/group_size, N/8] int32
    scales: torch.Tensor  # [(E,) K/group_size, N] float16/bfloat16/float32
    group_size: int

    def __post_init__(self) -> None:
        k, n8 = self.qweight.shape[-2:]
        g = k // self.group_size
        ok = (
            self.qweight.dtype == torch.int32 and self.qzeros.dtype == torch.int32
            and k % self.group_size == 0 and tuple(self.qzeros.shape[-2:]) == (g, n8)
            and tuple(self.scales.shape[-2:]) == (g, n8 * 8)
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"AwqInt4 group {self.group_size}: qweight {tuple(self.qweight.shape)} [K, N/8], "
                f"qzeros {tuple(self.qzeros.shape)} [K/group, N/8] int32, scales "
                f"{tuple(self.scales.shape)} [K/group, N]"
            )

    @property
    def shape(self) -> tuple[int, int]:
        k, n8 = self.qweight.shape[-2:]
        return (n8 * 8, k)

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        _check_aligned(n0, n1, self.shape[0], 8, "AwqInt4")
        cols = slice(n0 // 8, n1 // 8)
        words = self._at(self.qweight, expert)[:, cols].t().contiguous()  # [n/8, K]
        nibbles = [(words >> (4 * p)) & 0xF for p in AWQ_INVERSE_ORDER]  # column j of each 8
        u = torch.stack(nibbles, dim=1).view(n1 - n0, -1)  # [n/8, 8, K] -> [n, K]
        z = awq_columns(unpack_nibbles(self._at(self.qzeros, expert)[:, cols]))  # [G, n]
        s = self._at(self.scales, expert)[:, n0:n1].float()
        return _scaled_groups(u.float(), s.t(), z.t().float(), self.group_size)


@dataclass(frozen=True)
class Mxfp4Weight(_Packed):
    """OCP MXFP4 as gpt-oss ships its experts (`*_blocks`, `*_scales`): e2m1 codes two
    per byte (element 2j in the low nibble, 2j+1 in the high), one e8m0 scale per 32
    elements along K. W[n, k] = E2M1[code] * 2 ** (scales[n, k // 32] - 127)."""

    blocks: torch.Tensor  # [(E,) N, K/32, 16] uint8
    scales: torch.Tensor  # [(E,) N, K/32] uint8 (e8m0: the biased exponent)
    _matrix_dims = 3

    def __post_init__(self) -> None:
        ok = (
            self.blocks.dtype == torch.uint8 and self.scales.dtype == torch.uint8
            and self.blocks.shape[-1] == 16 and self.blocks.shape[:-1] == self.scales.shape
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"Mxfp4Weight: blocks {tuple(self.blocks.shape)} {self.blocks.dtype} must be "
                f"uint8 [..., N, K/32, 16], scales {tuple(self.scales.shape)} uint8 [..., N, K/32]"
            )

    @property
    def shape(self) -> tuple[int, int]:
        n, kb = self.blocks.shape[-3:-1]
        return (n, kb * 32)

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        b = self._at(self.blocks, expert)[n0:n1]  # [n, K/32, 16]
        values = byte_values(b, torch.tensor(E2M1_VALUES, device=b.device), high_first=False)
        exp = self._at(self.scales, expert)[n0:n1].float() - 127  # [n, K/32]
        return _scaled_groups(values.view(n1 - n0, -1), torch.exp2(exp), None, 32)


@dataclass(frozen=True)
class Nf4Weight(_Packed):
    """bitsandbytes 4-bit (QLoRA bases): W flattened row-major, two codes per byte
    (element 2i in the HIGH nibble, 2i+1 in the low), one absmax per `blocksize` flat
    elements. W.flatten()[i] = code[c_i] * absmax[i // blocksize]. Double-quantized
    checkpoints (`nested_absmax`) are turned into fp32 absmax at load
    (kernels.quant_pack.nf4_absmax)."""

    packed: torch.Tensor  # [N*K/2] uint8 (the checkpoint's [N*K/2, 1], flattened)
    absmax: torch.Tensor  # [ceil(N*K/blocksize)] float32
    code: torch.Tensor  # [16] float32: the checkpoint's quant_map (NF4_VALUES for nf4)
    shape: tuple[int, int]
    blocksize: int = 64
    _matrix_dims = 1

    def __post_init__(self) -> None:
        n, k = self.shape
        ok = (
            self.packed.dtype == torch.uint8 and self.packed.shape == (-(-n * k // 2),)
            and self.absmax.dtype == torch.float32
            and self.absmax.shape == (-(-n * k // self.blocksize),)
            and self.code.shape == (16,) and self.code.dtype == torch.float32
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"Nf4Weight {self.shape}: packed {tuple(self.packed.shape)} {self.packed.dtype} "
                f"must be uint8 [N*K/2], absmax {tuple(self.absmax.shape)} float32 "
                f"[N*K/{self.blocksize}], code [16] float32"
            )

    def dequantize_rows(self, n0: int, n1: int, expert: int | None = None) -> torch.Tensor:
        if expert is not None:
            raise ValueError("Nf4Weight: no stacked experts")
        k = self.shape[1]
        i0, i1 = n0 * k, n1 * k
        b = self.packed[i0 // 2 : -(-i1 // 2)]
        values = byte_values(b, self.code, high_first=True).view(-1)[i0 % 2 : i0 % 2 + i1 - i0]
        bs = self.blocksize
        if k % bs == 0:  # whole blocks in these rows: a broadcast, no gather
            absmax = self.absmax[i0 // bs : i1 // bs, None]
            return (values.view(-1, bs) * absmax).view(n1 - n0, k)
        flat = torch.arange(i0, i1, device=b.device) // bs
        return (values * self.absmax.index_select(0, flat)).view(n1 - n0, k)


QuantizedWeight = Fp8Weight | PackQuantizedInt4 | GptqInt4 | AwqInt4 | Mxfp4Weight | Nf4Weight


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """W dense in float32: [N, K], or [E, N, K] for stacked experts. The oracle of every
    quantized GEMM; a whole model is never dequantized through it at serve time."""
    n = w.shape[0]
    if w.num_experts is None:
        return w.dequantize_rows(0, n)
    return torch.stack([w.dequantize_rows(0, n, e) for e in range(w.num_experts)])


def stack_experts(ws: list[QuantizedWeight]) -> QuantizedWeight:
    """The experts' packed weights stacked into one (leading E dim on every tensor field),
    what quant_moe_gemm reads. All must share the format and its host fields."""
    kinds = {type(w) for w in ws}
    first = ws[0]
    plain = {f.name: getattr(first, f.name) for f in dataclasses.fields(first) if
             not isinstance(getattr(first, f.name), torch.Tensor | None)}  # fmt: skip
    if (
        len(kinds) != 1
        or any(w.num_experts is not None for w in ws)
        or any(getattr(w, name) != value for w in ws for name, value in plain.items())
    ):
        raise ValueError("stack_experts: one format, unstacked, the same shape and groups")
    fields = {}
    for f in dataclasses.fields(first):
        value = getattr(first, f.name)
        if isinstance(value, torch.Tensor):
            value = torch.stack([getattr(w, f.name) for w in ws])
        elif value is None and any(getattr(w, f.name) is not None for w in ws):
            raise ValueError(f"stack_experts: {f.name} missing on some experts")
        fields[f.name] = value
    return type(first)(**fields)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8*C] uint8: the 8 nibbles of each word, lowest bits first."""
    b = words.contiguous().view(torch.uint8)  # [R, 4*C], little-endian: low byte first
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(words.shape[0], -1)


def awq_columns(u: torch.Tensor) -> torch.Tensor:
    """[R, 8*C] codes unpacked from AWQ words (unpack_nibbles) -> the same in column
    order: column j of each 8 sits at nibble AWQ_INVERSE_ORDER[j]."""
    r, c8 = u.shape
    return u.view(r, c8 // 8, 8)[:, :, list(AWQ_INVERSE_ORDER)].reshape(r, c8)


def byte_values(b: torch.Tensor, code: torch.Tensor, high_first: bool) -> torch.Tensor:
    """b [...] uint8 holding two 4-bit codes -> [..., 2] float32 values code[c]: the low
    nibble first (MXFP4) or the high one first (bitsandbytes). One lookup per byte in a
    [256, 2] table."""
    every = torch.arange(256, device=b.device)
    pairs = (every >> 4, every & 0xF) if high_first else (every & 0xF, every >> 4)
    table = torch.stack([code.float()[pairs[0]], code.float()[pairs[1]]], dim=1)  # [256, 2]
    return table.index_select(0, b.reshape(-1).int()).view(*b.shape, 2)


def e4m3_over_256(w: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> float16 [...] holding value / 256, exactly. The 7 exponent
    and mantissa bits of e4m3 land in the low bits of fp16's 5-bit exponent and 10-bit
    mantissa (shifted left 7), which reads as the value times 2 ** (7 - 15), subnormals
    included; the sign bit moves to bit 15. (The two NaN codes read as +-480 / 256.) A
    few integer ops, where torch's own e4m3 -> fp32 cast is a slow scalar loop on CPU."""
    b = w.view(torch.uint8).to(torch.int16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).view(torch.float16)


def _scaled_groups(
    u: torch.Tensor,  # [n, K] float32 codes
    scale: torch.Tensor,  # [n, G] float32
    zero: torch.Tensor | None,  # [n, G] float32, or None
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int: each column's group; None: k // group_size
) -> torch.Tensor:  # [n, K] float32: (u - zero[:, g]) * scale[:, g]
    n, k = u.shape
    g = scale.shape[1]
    if g_idx is None and g * group_size == k:  # whole groups: a broadcast, no gather
        u = u.view(n * g, group_size)  # 2D: torch's CPU broadcast of a 3D view is far slower
        if zero is not None:
            u = u - zero.reshape(n * g, 1)
        return (u * scale.reshape(n * g, 1)).view(n, k)
    cols = (torch.arange(k, device=u.device) // group_size) if g_idx is None else g_idx.long()
    if zero is not None:
        u = u - zero.index_select(1, cols)
    return u * scale.index_select(1, cols)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a packed word holds column AWQ_ORDER[j]
AWQ_INVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits at nibble AWQ_INVERSE_ORDER[c]


def _check_aligned(n0: int, n1: int, n: int, align: int, what: str) -> None:
    if n0 % align or (n1 % align and n1 != n):
        raise ValueError(f"{what}: row tiles must start and end on multiples of {align}")


def _tensor_fields(w: object) -> list[torch.Tensor]:
    return [v for f in dataclasses.fields(w) if isinstance(v := getattr(w, f.name), torch.Tensor)]
