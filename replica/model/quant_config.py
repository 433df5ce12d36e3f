"""config.json's quantization_config -> what each projection's packed weight looks like, or
a refusal naming the quant_method.

One reader per quant_method (QUANT_METHODS, the dispatch); each returns a QuantScheme whose
`format_of(module)` says how a projection (by its checkpoint path, e.g.
`model.layers.0.self_attn.q_proj`) is stored: a ModuleFormat, or None when it stays dense
(`ignore`, `modules_to_not_convert`, a module no config group targets). Served packed:

  fp8                 Qwen / DeepSeek FP8: float8_e4m3fn `weight` with fp32
                      `weight_scale_inv` per weight_block_size block (per tensor without one)
  compressed-tensors  llm-compressor: `float-quantized` 8-bit float weights, per tensor or
                      channel (`weight_scale`); `pack-quantized` 4-bit int weights, per group
                      or channel, symmetric or not (`weight_packed`, `weight_scale`,
                      `weight_zero_point`, `weight_shape`)
  gptq                auto-gptq / gptqmodel v1 4-bit (`qweight`, `qzeros`, `scales`, `g_idx`),
                      desc_act included
  awq                 AutoAWQ GEMM 4-bit (`qweight`, `qzeros`, `scales`)
  bitsandbytes        NF4 (QLoRA's `*-bnb-4bit` bases): `weight` bytes, `weight.absmax`
                      (double-quantized too), `weight.quant_map`, `weight.quant_state.*`

  mxfp4               gpt-oss's experts (`*_blocks` e2m1 codes, `*_scales` e8m0 per 32
                      inputs): the one method its family reads (FAMILY_METHODS); its
                      attention, router and head stay dense as the Hub ships them
Activations are not quantized (W8A16 / W4A16): activation scales a checkpoint ships are
read and left unused, so outputs equal the dequantized model's. An FP8 checkpoint made for
dynamic per-token activation scales (fp8's `activation_scheme: dynamic`, llm-compressor's
FP8_DYNAMIC) runs W8A8 where a GPU has FP8 tensor cores (sm89+), as it was calibrated to.
Anything else is refused in one line naming its quant_method and what is served.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import gcd as _gcd
from typing import Any

from replica.model.hf_config import ModelConfigError

# Where config.json declares a quantized checkpoint (transformers' quantization_config;
# compressed-tensors' older compression_config).
QUANTIZATION_KEYS = ("quantization_config", "compression_config")
FP8, INT4_PACKED, GPTQ, AWQ, NF4, MXFP4 = "fp8", "pack-quantized", "gptq", "awq", "nf4", "mxfp4"
MXFP4_GROUP = 32  # inputs per e8m0 scale


@dataclass(frozen=True)
class ModuleFormat:
    """How one projection W [N, K] is stored. `block` (fp8): (rows, cols) per scale, None
    for per tensor, (1, None) per channel; `group_size` (int4): columns per scale, None per
    channel (the whole K)."""

    kind: str  # FP8, INT4_PACKED, GPTQ, AWQ, NF4 or MXFP4
    block: tuple[int | None, int | None] | None = None
    group_size: int | None = None
    symmetric: bool = True
    desc_act: bool = False  # GPTQ's act-order: g_idx maps each input column to its group
    scale_name: str = "weight_scale"  # fp8: weight_scale_inv (Qwen/DeepSeek) or weight_scale
    extra: tuple[str, ...] = ()  # tensors the checkpoint may ship that are read, unused
    # fp8: the checkpoint quantizes activations per token at run time (W8A8): done on an
    # FP8 tensor-core GPU (quant_weights.runs_w8a8), W8A16 elsewhere
    act_fp8: bool = False

    def groups(self, k: int) -> int:
        """Scale columns (fp8) or groups (int4) along an input of k columns."""
        step = self.block[1] if self.kind == FP8 and self.block else self.group_size
        return 1 if step is None else -(-k // step)  # MXFP4: group_size 32

    def out_align(self) -> int:
        """Rows a tensor-parallel split of the output must be a multiple of."""
        if self.kind == FP8:
            return (self.block[0] or 1) if self.block else 1
        if self.kind == NF4:  # whole absmax blocks of the row-major flat weight
            return self.group_size
        return 8 if self.kind in (GPTQ, AWQ) or not self.symmetric else 1

    def in_align(self) -> int:
        """Columns a split of the input must be a multiple of: whole scale blocks or
        groups, whole packed words; 0: the input cannot be split."""
        if self.kind == NF4:
            return 0  # blocks run along the flattened rows: a column split cuts them all
        if self.kind == FP8:
            return (self.block[1] or 1) if self.block else 1
        if self.group_size is None or (self.kind == GPTQ and self.desc_act):
            return 8  # one group per row, or g_idx naming every column's: any packed word
        return self.group_size * 8 // _gcd(self.group_size, 8)

    def packed_bytes(self, n: int, k: int, scale_bytes: int = 2, whole_k: int | None = None) -> int:
        """Device bytes of this rank's [n, k] part held packed (scales of fp8 in fp32, of
        int4 formats as stored: `scale_bytes`). `whole_k`: the unsplit input of a GPTQ
        desc_act weight, whose every group stays on each rank."""
        if self.kind == FP8:
            bn, bk = self.block or (n, k)
            return n * k + -(-n // (bn or n)) * -(-k // (bk or k)) * 4
        if self.kind == NF4:  # codes, fp32 absmax (double quantization undone), the code
            return -(-n * k // 2) + -(-n * k // self.group_size) * 4 + 16 * 4
        if self.kind == MXFP4:  # two codes a byte, one e8m0 byte per group
            return n * (k // 2 + self.groups(k))
        g = self.groups(whole_k if self.desc_act and whole_k else k)
        codes = n * -(-k // 8) * 4  # 8 codes an int32, along K (pack-quantized, GPTQ) or N
        scales = n * g * scale_bytes
        zeros = 0 if self.kind == INT4_PACKED and self.symmetric else -(-n // 8) * g * 4
        g_idx = k * 4 if self.kind == GPTQ and self.desc_act else 0
        return codes + scales + zeros + g_idx


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: the formats of its projections by module path."""

    method: str  # config.json's quant_method
    groups: tuple[tuple[tuple[str, ...], ModuleFormat], ...]  # (targets, format), first wins
    dense: tuple[str, ...] = ()  # ignore / modules_to_not_convert patterns

    def format_of(self, module: str, *aliases: str) -> ModuleFormat | None:
        """The format `module` (a Linear's checkpoint path) is stored in; None: dense.
        `aliases`: the module's paths under the family's other checkpoint prefixes (a
        multimodal wrapper's model.language_model. or a text-only export's model.): it
        is dense when ignored under any of its names, as config.json's lists may name it
        either way."""
        names = (module, *aliases)
        if any(_matches(pattern, name) for pattern in self.dense for name in names):
            return None
        for targets, fmt in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets for name in names):
                return fmt
        return None


def quant_scheme(cfg: dict[str, Any], source: str) -> QuantScheme | None:
    """The quantization config.json (or a multimodal checkpoint's text_config) declares,
    None for a plain checkpoint; ModelConfigError naming the quant_method (and the field)
    for one this server does not serve exactly."""
    for where in (cfg, cfg.get("text_config") or {}):
        for key in QUANTIZATION_KEYS:
            quant = where.get(key) if isinstance(where, dict) else None
            if quant is None:
                continue
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else "unnamed"
            own = FAMILY_METHODS.get(cfg.get("model_type"))
            if own is not None:
                if method == own[0]:
                    return own[1]
                raise ModelConfigError(
                    f"{source}: {key} with quant_method={method!r} is not served for "
                    f"{cfg.get('model_type')} (its {own[0]} is)"
                )
            reader = QUANT_METHODS.get(method)
            if reader is None:
                raise ModelConfigError(
                    f"{source}: {key} with quant_method={method!r} is not served (served: "
                    f"{', '.join(QUANT_METHODS)}; their packed weights and scales would "
                    "otherwise be read as plain weights); serve the unquantized model"
                )
            return reader(quant, f"{source}: {key} with quant_method={method!r}")
    return None


def _fp8(q: dict[str, Any], where: str) -> QuantScheme:
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError(f"{where}: fmt={q.get('fmt')!r} is not served (only e4m3)")
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) for b in block)):
        raise ModelConfigError(f"{where}: weight_block_size={block!r}: expected [rows, cols]")
    fmt = ModuleFormat(FP8, tuple(block) if block else None, scale_name="weight_scale_inv",
                       extra=("activation_scale", "input_scale"),
                       act_fp8=q.get("activation_scheme") == "dynamic")  # fmt: skip
    return QuantScheme("fp8", ((("Linear",), fmt),), _names(q.get("modules_to_not_convert")))


def _compressed_tensors(q: dict[str, Any], where: str) -> QuantScheme:
    groups = []
    for name, group in (q.get("config_groups") or {}).items():
        fmt_name = group.get("format") or q.get("format")
        args = group.get("weights") or {}
        here = f"{where}, config group {name!r}"
        fmt = _ct_format(fmt_name, args, here)
        if fmt.kind == FP8 and _dynamic_fp8(group.get("input_activations")):
            fmt = replace(fmt, act_fp8=True)
        groups.append((tuple(group.get("targets") or ()), fmt))
    if not groups:
        raise ModelConfigError(f"{where}: no config_groups: nothing says how weights are stored")
    return QuantScheme("compressed-tensors", tuple(groups), _names(q.get("ignore")))


def _dynamic_fp8(activations: dict[str, Any] | None) -> bool:
    """compressed-tensors input_activations that say: FP8, scaled per token at run time
    (llm-compressor's FP8_DYNAMIC)."""
    a = activations or {}
    return (a.get("type"), a.get("num_bits"), a.get("dynamic"), a.get("strategy")) == (
        "float",
        8,
        True,
        "token",
    )


def _ct_format(fmt: str | None, w: dict[str, Any], where: str) -> ModuleFormat:
    strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
    wanted = {"float-quantized": ("float", 8, ("tensor", "channel")),
              "pack-quantized": ("int", 4, ("group", "channel"))}  # fmt: skip
    if fmt not in wanted:
        raise ModelConfigError(f"{where}: format={fmt!r} is not served (served: "
                               f"{', '.join(wanted)})")  # fmt: skip
    want_type, want_bits, strategies = wanted[fmt]
    if kind != want_type or bits != want_bits or strategy not in strategies:
        raise ModelConfigError(
            f"{where}: {fmt} weights of type={kind!r} num_bits={bits!r} strategy="
            f"{strategy!r} are not served ({want_bits}-bit {want_type}, strategy "
            f"{' or '.join(strategies)})"
        )
    if w.get("actorder") not in (None, "weight", "static"):
        raise ModelConfigError(f"{where}: actorder={w.get('actorder')!r} is not served")
    if fmt == "float-quantized":
        if not w.get("symmetric", True):
            raise ModelConfigError(f"{where}: asymmetric float weights are not served")
        block = (1, None) if strategy == "channel" else None
        return ModuleFormat(FP8, block, extra=("input_scale",))
    group = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group, int) and group > 0):
        raise ModelConfigError(f"{where}: group strategy with group_size={group!r}")
    return ModuleFormat(INT4_PACKED, group_size=group, symmetric=bool(w.get("symmetric", True)))


def _gptq(q: dict[str, Any], where: str) -> QuantScheme:
    _check_int4(q, where)
    if q.get("checkpoint_format", "gptq") != "gptq":
        raise ModelConfigError(
            f"{where}: checkpoint_format={q.get('checkpoint_format')!r} is not served (the "
            "v1 'gptq' packing is)"
        )
    if q.get("lm_head"):
        raise ModelConfigError(f"{where}: a quantized lm_head is not served")
    fmt = ModuleFormat(GPTQ, group_size=_group(q, where), desc_act=bool(q.get("desc_act")))
    return QuantScheme("gptq", ((("Linear",), fmt),), _names(q.get("modules_to_not_convert")))


def _awq(q: dict[str, Any], where: str) -> QuantScheme:
    _check_int4(q, where)
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm" or not q.get("zero_point", True):
        raise ModelConfigError(
            f"{where}: version={q.get('version')!r} zero_point={q.get('zero_point')!r} is "
            "not served (the GEMM packing with zero points is)"
        )
    fmt = ModuleFormat(AWQ, group_size=_group(q, where), symmetric=False)
    return QuantScheme("awq", ((("Linear",), fmt),), _names(q.get("modules_to_not_convert")))


def _bitsandbytes(q: dict[str, Any], where: str) -> QuantScheme:
    kind = q.get("bnb_4bit_quant_type", "fp4")
    four_bit = q.get("load_in_4bit", q.get("_load_in_4bit"))
    if not four_bit or kind != "nf4":
        raise ModelConfigError(
            f"{where}: load_in_4bit={four_bit!r} load_in_8bit="
            f"{q.get('load_in_8bit')!r} bnb_4bit_quant_type={kind!r} is not served (4-bit "
            "nf4 is)"
        )
    fmt = ModuleFormat(NF4, group_size=64, scale_name="weight.absmax")
    return QuantScheme(
        "bitsandbytes", ((("Linear",), fmt),), _names(q.get("llm_int8_skip_modules"))
    )


def _check_int4(q: dict[str, Any], where: str) -> None:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ModelConfigError(f"{where}: bits={bits!r} is not served (4-bit weights are)")


def _group(q: dict[str, Any], where: str) -> int | None:
    group = q.get("group_size", q.get("q_group_size", 128))
    if group == -1:
        return None
    if not (isinstance(group, int) and group > 0):
        raise ModelConfigError(f"{where}: group_size={group!r}")
    return group


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value or ())


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' `re:` regex (matched in full), else a module name: the path
    itself, or (transformers' modules_to_not_convert) a dotted part of it."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return module == pattern or f".{pattern}." in f".{module}."


# model_type -> the one quant_method its family ships and reads, and what it stores packed:
# gpt-oss's MXFP4 experts (model/layout.py reads their stacked *_blocks / *_scales).
FAMILY_METHODS: dict[str, tuple[str, QuantScheme]] = {
    "gpt_oss": (
        MXFP4,
        QuantScheme(
            MXFP4, (((r"re:.*\.mlp\.experts\..*",), ModuleFormat(MXFP4, group_size=MXFP4_GROUP)),)
        ),
    ),
}

QUANT_METHODS: dict[str, Callable[[dict[str, Any], str], QuantScheme]] = {
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
    "gptq": _gptq,
    "awq": _awq,
    "bitsandbytes": _bitsandbytes,
}
