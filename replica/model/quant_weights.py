"""A projection's packed weight read from the checkpoint as its format stores it, this
rank's rows or columns of it, and the linear layer that multiplies by it packed.

read_packed returns a kernels.quant_formats weight (Fp8Weight, PackQuantizedInt4, GptqInt4,
AwqInt4) whose tensors are the checkpoint's, sliced along whole scale blocks, groups and
packed words (a split that would cut one is refused at plan time, tp_shard.py), so the
device holds what the checkpoint holds. PackedLinear multiplies by a list of such parts
(q, k and v; gate and up) through kernels.quant_linear, which dequantizes tile by tile.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import torch

import kernels
from kernels import AwqInt4, Fp8Weight, GptqInt4, Nf4Weight, PackQuantizedInt4, QuantizedWeight
from kernels.quant_formats import NF4_VALUES
from kernels.quant_pack import nf4_absmax
from replica.model.quant_config import AWQ, FP8, GPTQ, INT4_PACKED, NF4, ModuleFormat
from replica.model.weights import Checkpoint, DummyCheckpoint, WeightLoadError

I32, F8 = (torch.int32,), (torch.float8_e4m3fn,)
SCALES = (torch.bfloat16, torch.float16, torch.float32)
Range = tuple[int, int]


def read_packed(
    ckpt: Checkpoint | DummyCheckpoint,
    name: str,  # the module's checkpoint path, e.g. model.layers.0.self_attn.q_proj
    fmt: ModuleFormat,
    shape: tuple[int, int],  # (N, K) of the whole weight
    rows: Range | None = None,  # this rank's output rows; None: all
    cols: Range | None = None,  # this rank's input columns; None: all
) -> QuantizedWeight:
    """This rank's part of `name`'s packed weight, as stored (float8 scales in fp32)."""
    n, k = shape
    read = {FP8: _read_fp8, INT4_PACKED: _read_pack_quantized, GPTQ: _read_gptq, AWQ: _read_awq,
            NF4: _read_nf4}  # fmt: skip
    w = read[fmt.kind](ckpt, name, fmt, n, k)
    for extra in fmt.extra:  # activation scales: W8A16 leaves them unused
        if isinstance(ckpt, Checkpoint) and ckpt.has(f"{name}.{extra}"):
            ckpt.get_packed(f"{name}.{extra}", ckpt.shape(f"{name}.{extra}"), SCALES)
    if rows is not None and rows != (0, n):
        w = slice_rows(w, *rows)
    if cols is not None and cols != (0, k):
        w = slice_cols(w, *cols)
    return w


def _read_fp8(ckpt, name: str, fmt: ModuleFormat, n: int, k: int) -> Fp8Weight:
    weight = ckpt.get_packed(f"{name}.weight", (n, k), F8)
    bn, bk = fmt.block or (n, k)
    bn, bk = bn or n, bk or k
    grid = (-(-n // bn), -(-k // bk))
    scale_name = f"{name}.{fmt.scale_name}"
    shapes = [grid] + ([(1,), ()] if grid == (1, 1) else []) + ([(n,)] if bk == k else [])
    stored = ckpt.shape(scale_name) or grid  # (a dummy checkpoint has no shapes)
    if tuple(stored) not in shapes:
        raise WeightLoadError(
            f"{ckpt.dir}: {scale_name!r} has shape {tuple(stored)}; a {n}x{k} weight in "
            f"blocks of {bn}x{bk} has scales {grid}"
        )
    scale = ckpt.get_packed(scale_name, tuple(stored), (torch.float32, *SCALES))
    return Fp8Weight(weight, scale.float().reshape(grid), (bn, bk), fmt.act_fp8)


def _read_pack_quantized(ckpt, name: str, fmt: ModuleFormat, n: int, k: int) -> PackQuantizedInt4:
    group = fmt.group_size or k
    g = -(-k // group)
    stored = ckpt.get_packed(f"{name}.weight_shape", (2,), (torch.int64, torch.int32))
    if not isinstance(ckpt, DummyCheckpoint) and stored.tolist() != [n, k]:
        raise WeightLoadError(
            f"{ckpt.dir}: {name}.weight_shape is {stored.tolist()}, config.json implies {[n, k]}"
        )
    packed = ckpt.get_packed(f"{name}.weight_packed", (n, -(-k // 8)), I32)
    scale = ckpt.get_packed(f"{name}.weight_scale", (n, g), SCALES)
    zp = None
    if not fmt.symmetric:
        zp = ckpt.get_packed(f"{name}.weight_zero_point", (-(-n // 8), g), I32)
    return PackQuantizedInt4(packed, scale, zp, (n, k), group)


def _read_gptq(ckpt, name: str, fmt: ModuleFormat, n: int, k: int) -> GptqInt4:
    group = fmt.group_size or k
    g = -(-k // group)
    qweight = ckpt.get_packed(f"{name}.qweight", (k // 8, n), I32)
    qzeros = ckpt.get_packed(f"{name}.qzeros", (g, n // 8), I32)
    scales = ckpt.get_packed(f"{name}.scales", (g, n), SCALES)
    g_idx = None
    if isinstance(ckpt, DummyCheckpoint):  # act-order's g_idx held, in the default order
        if fmt.desc_act:
            g_idx = (torch.arange(k, device=ckpt.device) // group).to(torch.int32)
    elif ckpt.has(f"{name}.g_idx"):
        g_idx = ckpt.get_packed(f"{name}.g_idx", (k,), I32)
        if torch.equal(g_idx.long(), torch.arange(k) // group):
            g_idx = None  # the default order: groups are contiguous, no gather needed
    _check_bias(ckpt, name)
    return GptqInt4(qweight, qzeros, scales, g_idx, group)


def _read_awq(ckpt, name: str, fmt: ModuleFormat, n: int, k: int) -> AwqInt4:
    group = fmt.group_size or k
    if k % group:
        raise WeightLoadError(f"{ckpt.dir}: {name} has {k} input columns, not a multiple of "
                              f"AWQ's group_size {group}")  # fmt: skip
    qweight = ckpt.get_packed(f"{name}.qweight", (k, n // 8), I32)
    qzeros = ckpt.get_packed(f"{name}.qzeros", (k // group, n // 8), I32)
    scales = ckpt.get_packed(f"{name}.scales", (k // group, n), SCALES)
    _check_bias(ckpt, name)
    return AwqInt4(qweight, qzeros, scales, group)


def _read_nf4(ckpt, name: str, fmt: ModuleFormat, n: int, k: int) -> Nf4Weight:
    """bitsandbytes' serialized Params4bit: its quant_state JSON (a uint8 tensor) names the
    block size and, double-quantized, how the absmax was itself quantized."""
    w = f"{name}.weight"
    if isinstance(ckpt, DummyCheckpoint):
        packed = ckpt.get_packed(w, (-(-n * k // 2), 1), (torch.uint8,))
        absmax = ckpt.get_packed(f"{w}.absmax", (-(-n * k // 64),), (torch.float32,))
        code = torch.tensor(NF4_VALUES, device=ckpt.device)
        return Nf4Weight(packed.view(-1), absmax, code, (n, k), 64)
    state_name = f"{w}.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(ckpt.get_packed(state_name, ckpt.shape(state_name),
                                             (torch.uint8,)).tolist()))  # fmt: skip
    if list(state.get("shape", ())) != [n, k] or state.get("quant_type") != "nf4":
        raise WeightLoadError(f"{ckpt.dir}: {state_name!r} says {state}, config.json implies "
                              f"an nf4 weight of shape {[n, k]}")  # fmt: skip
    bs = int(state["blocksize"])
    packed = ckpt.get_packed(w, (-(-n * k // 2), 1), (torch.uint8,)).view(-1)
    code = ckpt.get_packed(f"{w}.quant_map", (16,), (torch.float32,))
    blocks = -(-n * k // bs)
    if "nested_blocksize" in state:  # double quantization: absmax as 8-bit codes
        nested = int(state["nested_blocksize"])
        codes = ckpt.get_packed(f"{w}.absmax", (blocks,), (torch.uint8,))
        scale = ckpt.get_packed(f"{w}.nested_absmax", (-(-blocks // nested),), (torch.float32,))
        table = ckpt.get_packed(f"{w}.nested_quant_map", (256,), (torch.float32,))
        absmax = nf4_absmax(codes, scale, table, float(state["nested_offset"]), nested)
    else:
        absmax = ckpt.get_packed(f"{w}.absmax", (blocks,), (torch.float32,))
    return Nf4Weight(packed, absmax, code, (n, k), bs)


def _check_bias(ckpt, name: str) -> None:
    """auto-gptq and AutoAWQ may save an all-zero bias for bias-free projections: read and
    accepted when zero, refused otherwise (the decoder adds none there)."""
    bias = f"{name}.bias"
    if isinstance(ckpt, Checkpoint) and ckpt.has(bias) and not bias.endswith(QKV_BIAS):
        if ckpt.get(bias, ckpt.shape(bias)).any():
            raise WeightLoadError(f"{ckpt.dir}: {bias!r} is non-zero on a projection "
                                  "without a bias in this family")  # fmt: skip


QKV_BIAS = ("q_proj.bias", "k_proj.bias", "v_proj.bias")  # read by the decoder (Qwen2)


def slice_rows(w: QuantizedWeight, r0: int, r1: int) -> QuantizedWeight:
    """Rows r0:r1 of W (output features), cut along whole blocks and packed words."""
    n, k = w.shape
    if isinstance(w, Fp8Weight):
        bn, bk = w.block
        if bn >= n:  # one scale row (per tensor): rows are cut anywhere
            return dataclasses.replace(w, weight=w.weight[r0:r1], block=(r1 - r0, bk))
        _aligned(r0, r1, n, bn, "rows", "FP8 scale blocks")
        return dataclasses.replace(
            w, weight=w.weight[r0:r1], scale=w.scale[r0 // bn : -(-r1 // bn)]
        )
    if isinstance(w, PackQuantizedInt4):
        zp = w.weight_zero_point
        if zp is not None:
            _aligned(r0, r1, n, 8, "rows", "packed zero points")
            zp = zp[r0 // 8 : -(-r1 // 8)]
        return PackQuantizedInt4(w.weight_packed[r0:r1], w.weight_scale[r0:r1], zp,
                                 (r1 - r0, k), w.group_size)  # fmt: skip
    _aligned(r0, r1, n, 8, "rows", "packed words")
    if isinstance(w, GptqInt4):
        return GptqInt4(w.qweight[:, r0:r1], w.qzeros[:, r0 // 8 : r1 // 8],
                        w.scales[:, r0:r1], w.g_idx, w.group_size)  # fmt: skip
    if isinstance(w, AwqInt4):
        return AwqInt4(w.qweight[:, r0 // 8 : r1 // 8], w.qzeros[:, r0 // 8 : r1 // 8],
                       w.scales[:, r0:r1], w.group_size)  # fmt: skip
    if isinstance(w, Nf4Weight):
        bs = w.blocksize
        if (r0 * k) % bs or ((r1 * k) % bs and r1 != n):
            raise WeightLoadError(f"rows {r0}:{r1} of an NF4 weight cut its blocks of {bs}")
        packed = w.packed[r0 * k // 2 : -(-r1 * k // 2)]
        absmax = w.absmax[r0 * k // bs : -(-r1 * k // bs)]
        return Nf4Weight(packed, absmax, w.code, (r1 - r0, k), bs)
    raise TypeError(f"slice_rows: {type(w).__name__}")


def slice_cols(w: QuantizedWeight, c0: int, c1: int) -> QuantizedWeight:
    """Columns c0:c1 of W (input features), cut along whole groups and packed words."""
    n, k = w.shape
    if isinstance(w, Fp8Weight):
        bn, bk = w.block
        if bk >= k:  # one scale column (per channel or tensor): columns are cut anywhere
            return dataclasses.replace(w, weight=w.weight[:, c0:c1], block=(bn, c1 - c0))
        _aligned(c0, c1, k, bk, "columns", "FP8 scale blocks")
        return dataclasses.replace(
            w, weight=w.weight[:, c0:c1], scale=w.scale[:, c0 // bk : -(-c1 // bk)]
        )
    if isinstance(w, PackQuantizedInt4):
        group = _group_after_cut(c0, c1, k, w.group_size)
        g0, g1 = c0 // w.group_size, -(-c1 // w.group_size)
        zp = None if w.weight_zero_point is None else w.weight_zero_point[:, g0:g1]
        return PackQuantizedInt4(w.weight_packed[:, c0 // 8 : -(-c1 // 8)],
                                 w.weight_scale[:, g0:g1], zp, (n, c1 - c0), group)  # fmt: skip
    if isinstance(w, GptqInt4):
        qweight = w.qweight[c0 // 8 : -(-c1 // 8)]
        if w.g_idx is not None:  # act-order: any column may use any group, all are kept
            _aligned(c0, c1, k, 8, "columns", "packed words")
            return GptqInt4(qweight, w.qzeros, w.scales, w.g_idx[c0:c1], w.group_size)
        group = _group_after_cut(c0, c1, k, w.group_size)
        g0, g1 = c0 // w.group_size, -(-c1 // w.group_size)
        return GptqInt4(qweight, w.qzeros[g0:g1], w.scales[g0:g1], None, group)
    if isinstance(w, AwqInt4):
        _aligned(c0, c1, k, w.group_size, "columns", "groups")
        g0, g1 = c0 // w.group_size, c1 // w.group_size
        return AwqInt4(w.qweight[c0:c1], w.qzeros[g0:g1], w.scales[g0:g1], w.group_size)
    raise TypeError(f"slice_cols: {type(w).__name__}")


def _group_after_cut(c0: int, c1: int, k: int, group: int) -> int:
    """The group size of columns c0:c1 of a [N, k] int4 weight: one group per row (group
    >= k) is cut anywhere on packed words and stays one group; smaller groups stay whole."""
    if group >= k:
        _aligned(c0, c1, k, 8, "columns", "packed words")
        return c1 - c0
    _aligned(c0, c1, k, group * 8 // math.gcd(group, 8), "columns", "groups and packed words")
    return group


def _aligned(start: int, stop: int, total: int, align: int, what: str, unit: str) -> None:
    if start % align or (stop % align and stop != total):
        raise WeightLoadError(
            f"{what} {start}:{stop} of {total} cut {unit} of {align}: refused (a "
            "tensor-parallel split must keep every quantization group whole: a smaller "
            "tp_size may)"
        )


def to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    """`w` with every tensor contiguous on `device`, dtypes as stored."""
    moved = {
        f.name: v.to(device).contiguous() if isinstance(v := getattr(w, f.name), torch.Tensor)
        else v
        for f in dataclasses.fields(w)
    }  # fmt: skip
    return type(w)(**moved)


def tensors_of(w: QuantizedWeight | torch.Tensor | PackedLinear) -> list[torch.Tensor]:
    """The tensors a weight holds (itself when dense)."""
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, PackedLinear):
        return w.tensors()
    return [v for f in dataclasses.fields(w) if isinstance(v := getattr(w, f.name), torch.Tensor)]


def on_device(
    w: QuantizedWeight | torch.Tensor, device: torch.device, dtype: torch.dtype
) -> QuantizedWeight | torch.Tensor:
    """A dense weight in the engine's `dtype` on `device`; a packed one as stored."""
    if isinstance(w, torch.Tensor):
        return w.to(device=device, dtype=dtype)
    return to_device(w, device)


def fused_weight(parts: list[QuantizedWeight | torch.Tensor]) -> torch.Tensor | PackedLinear:
    """The base weight of a projection group whose outputs sit side by side (q, k, v; gate,
    up; a Gated DeltaNet's qkv, z, b, a): one dense tensor when every part is dense, else
    the parts as they are (packed ones stay packed, an ignored module dense)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    return PackedLinear(parts)


class PackedLinear:
    """y = x · [W_0; W_1; ...]ᵀ (+ bias): the parts' outputs side by side (q, k, v), each
    part packed (kernels.quant_linear, activations unquantized) or dense (an ignored
    module, a bias-carrying or a mixed group)."""

    def __init__(self, parts: list[QuantizedWeight | torch.Tensor]) -> None:
        self.parts = parts
        sizes = [p.shape[0] for p in parts]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    @property
    def out_features(self) -> int:
        return self.bounds[-1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in tensors_of(p)]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.parts) == 1:
            return _part(x, self.parts[0], bias)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for part, lo, hi in zip(self.parts, self.bounds, self.bounds[1:]):
            out[:, lo:hi] = _part(x, part, None if bias is None else bias[lo:hi])
        return out


def _part(x: torch.Tensor, w: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None):
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, bias)
    return kernels.quant_linear(x, w, bias, act_fp8=runs_w8a8(w, x.device))


# The Triton GEMM quantizes activations per K tile of this many columns (kernels.quant_triton)
W8A8_BLOCK_K = 64


def runs_w8a8(w: QuantizedWeight, device: torch.device) -> bool:
    """Whether `w` multiplies FP8 activations (W8A8): an FP8 weight whose checkpoint asks
    for dynamic per-token activation scales, whole scale blocks per K tile, on a GPU with
    FP8 tensor cores (sm89+). Everywhere else activations stay unquantized (W8A16), which
    is what the CPU path and the exactness tests compute."""
    return (
        isinstance(w, Fp8Weight)
        and w.dynamic_activations
        and w.block[1] % W8A8_BLOCK_K == 0
        and device.type == "cuda"
        and _fp8_tensor_cores(device.index)
    )


@functools.cache
def _fp8_tensor_cores(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)
