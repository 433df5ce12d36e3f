"""What one tensor-parallel rank holds of every packed projection of a quantized checkpoint:
the tensor-parallel splits that would cut a scale block or group, and the bytes held.

Pure arithmetic on the model's shape and its QuantScheme, no tensors. One list of shares
(packed_shares) walks each layer as the model loads it: attention's q/k/v/o or a Gated
DeltaNet's in_proj_qkv (its q, k and v rows apart under tensor parallelism: three
shares), in_proj_z/b/a and out_proj; the dense MLP (also beside Gemma 4's experts), a
sparse layer's experts (expert 0's path standing for all, gpt-oss's stacked tensors';
Gemma 4's only when its checkpoint un-fused them, spec.experts_unfused; each rank's held
columns, expert_group), Qwen3.5-MoE's shared expert;
Gemma 4's per-layer-input gate and projection and its model-level
per_layer_model_projection (replicated). A module the scheme leaves
dense (`ignore`, `modules_to_not_convert`) has no share. The plan (executor/memory_plan.py)
counts the shares' packed bytes; tp_shard.py refuses a split whose share cuts one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from replica.model.hybrid import LINEAR_IN_MODULES
from replica.model.quant_config import MXFP4, MXFP4_GROUP, ModuleFormat
from replica.model.spec import ModelSpec

Range = tuple[int, int]


class RankShard(Protocol):
    """What this module reads of model/tp_shard.py's TPShard (which calls it: a protocol,
    not an import, keeps the two acyclic)."""

    spec: ModelSpec
    rank: int
    size: int

    def layer(self, layer: int) -> RankShard: ...
    def out_range(self, module: str) -> Range: ...
    def in_range(self, module: str) -> Range: ...
    def qkv_rows(self) -> list[Range]: ...
    @property
    def expert_held_range(self) -> Range: ...
    @property
    def shared_expert_range(self) -> Range: ...


UNITS = {"fp8": "scale blocks", "nf4": "absmax blocks (along flattened rows)"}


@dataclass(frozen=True)
class PackedShare:
    path: str  # the module's checkpoint path (expert 0's, or the stack's, for the experts)
    fmt: ModuleFormat
    whole: tuple[int, int]  # (N, K) of the whole weight
    rows: Range  # this rank's output rows
    cols: Range  # this rank's input columns
    count: int = 1  # weights of this shape and format (a layer's experts)

    def packed_bytes(self, scale_bytes: int = 2) -> int:
        """Bytes this rank holds of it packed (all `count` of them)."""
        n, k = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        return self.count * self.fmt.packed_bytes(n, k, scale_bytes, whole_k=self.whole[1])

    def dense_bytes(self, dtype: torch.dtype) -> int:
        """Bytes it would hold unquantized in `dtype`."""
        n, k = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        return self.count * n * k * dtype.itemsize

    def cut(self, method: str, rank: int) -> str | None:
        """Why this share cannot be dequantized on its own (it starts or ends inside a
        scale block, a group or a packed word), None when it can."""
        n, k = self.whole
        for what, (lo, hi), total, align in (
            ("output rows", self.rows, n, self.fmt.out_align()),
            ("input columns", self.cols, k, self.fmt.in_align()),
        ):
            if (lo, hi) == (0, total):
                continue
            unit = UNITS.get(self.fmt.kind, "groups or packed words")
            if align == 0:
                return (f"{self.path} ({method}): its {what} cannot be split, every one of "
                        f"its {unit} spans them")  # fmt: skip
            if lo % align or (hi % align and hi != total):
                return (f"{self.path} ({method}): its {what} {lo}:{hi} on rank {rank} cut its "
                        f"{unit} of {align}")  # fmt: skip
        return None


def packed_shares(shard: RankShard) -> list[PackedShare]:
    """`shard`'s rank's share of every packed projection, layer by layer."""
    s = shard.spec
    if s.quant is None:
        return []
    modules = []
    if s.per_layer_input_size:  # Gemma 4's per_layer_model_projection, whole on every rank
        n, h = s.num_layers * s.per_layer_input_size, s.hidden_size
        modules.append(("per_layer_model_projection", (n, h), [((0, n), (0, h))]))
    for layer in range(s.num_layers):
        modules += _layer_modules(shard.layer(layer), layer)
    shares = []
    for rel, whole, parts in modules:
        # the path under the first prefix names it; a config may name it under any
        first, *others = (prefix + rel for prefix in s.weight_prefixes)
        fmt = s.quant.format_of(first, *others)
        if fmt is not None:
            count = s.num_experts if ".experts." in rel else 1
            shares += [PackedShare(first, fmt, whole, r, c, count) for r, c in parts]
    return shares


def quantization_cuts(shard: RankShard) -> list[str]:
    """Each packed projection whose share on `shard`'s rank would cut a scale block, a
    group or a packed word (model/quant_config.py's alignments): the rank could not
    dequantize it. Every rank's bounds are multiples of rank 0's share (gpt-oss's MXFP4
    experts' held columns whole groups on every rank), so checking one rank's is checking
    them all."""
    if shard.spec.quant is None or shard.size == 1:
        return []
    found = (share.cut(shard.spec.quant.method, shard.rank) for share in packed_shares(shard))
    return [cut for cut in found if cut is not None]


def expert_group(spec: ModelSpec) -> int:
    """Intermediate columns a rank's share of each expert is rounded out to: MXFP4_GROUP
    where gpt-oss's experts are MXFP4 (its down_proj keeps a scale per 32 inputs, and a
    zero gate makes a column's clamped SwiGLU exactly 0: model/tp_shard.py), else 1 (other
    formats' splits that cut a group are refused)."""
    quant = spec.quant
    if quant is None or spec.expert_layout != "gpt_oss" or not spec.num_experts:
        return 1
    layer = next(i for i in range(spec.num_layers) if spec.is_sparse(i))
    paths = [f"{prefix}layers.{layer}.mlp.experts.down_proj" for prefix in spec.weight_prefixes]
    fmt = quant.format_of(*paths)
    return MXFP4_GROUP if fmt is not None and fmt.kind == MXFP4 else 1


def packed_difference(shard: RankShard, dtype: torch.dtype) -> int:
    """What `shard`'s rank holds of the packed projections and experts less what they would
    hold in `dtype` (negative: the saving). int4 scales are counted in 16 bits, as
    llm-compressor, auto-gptq and AutoAWQ store them; float8 scales in fp32."""
    return sum(p.packed_bytes() - p.dense_bytes(dtype) for p in packed_shares(shard))


Parts = list[tuple[Range, Range]]  # (rows, cols) of each part a rank holds


def _layer_modules(shard: RankShard, layer: int) -> list[tuple[str, tuple[int, int], Parts]]:
    """(checkpoint path below the prefix, whole (N, K), this rank's parts) of every
    projection `layer` loads, whatever its format; `shard`: the layer's own."""
    s = shard.spec
    whole = s.module_shapes()
    split = shard.size > 1
    out: list[tuple[str, tuple[int, int], Parts]] = []

    def add(module: str, path: str | None = None, offset: int = 0, total: int = 0) -> None:
        k, n = whole[module]
        rows, cols = (0, n), (0, k)
        if split and module in ("o_proj", "down_proj", "out_proj"):
            cols = shard.in_range(module)
        elif split:
            rows = shard.out_range(module)
        rows = (rows[0] + offset, rows[1] + offset)
        out.append((path or s.module_path(layer, module, ""), (total or n, k), [(rows, cols)]))

    fused = s.fused_modules()

    def add_group(modules: tuple[str, ...], name: str) -> None:
        if name not in fused:
            for m in modules:
                add(m)
            return
        total, first = sum(whole[p][1] for p in modules), 0
        for m in modules:  # each part's rows of the fused checkpoint tensor
            add(m, s.module_path(layer, name, ""), first, total)
            first += whole[m][1]

    if s.is_linear(layer):
        k, n = whole["in_proj_qkv"]
        rows = shard.qkv_rows() if split else [(0, n)]
        out.append((s.module_path(layer, "in_proj_qkv", ""), (n, k), [(r, (0, k)) for r in rows]))
        for m in (*LINEAR_IN_MODULES[1:], "out_proj"):
            add(m)
    else:
        add_group(("q_proj",) + tuple(m for m in ("k_proj", "v_proj")
                                      if s.has_kv_projection(layer, m)), "qkv_proj")  # fmt: skip
        add("o_proj")
    if not s.is_sparse(layer) or s.moe_beside_mlp:
        add_group(("gate_proj", "up_proj"), "gate_up_proj")
        add("down_proj")
    if s.is_sparse(layer):
        out += _experts(shard, layer)
    h, w = s.hidden_size, s.per_layer_input_size
    if w:  # Gemma 4's per-layer-input gate and projection, whole on every rank
        where = f"layers.{layer}."
        out += [(where + "per_layer_input_gate", (w, h), [((0, w), (0, h))]),
                (where + "per_layer_projection", (h, w), [((0, h), (0, w))])]  # fmt: skip
    return out


def _experts(shard: RankShard, layer: int) -> list[tuple[str, tuple[int, int], Parts]]:
    """A sparse layer's experts (expert 0's path for all; gpt-oss's stacked gate_up_proj
    and down_proj) and Qwen3.5-MoE's shared expert. Gemma 4's stacked experts (or, with
    no checkpoint read, experts it may have stacked) are held dense: no share
    (model/layout.py reads the same spec.experts_unfused)."""
    s = shard.spec
    h, i = s.hidden_size, s.moe_intermediate_size
    prefix = f"layers.{layer}."
    out = []
    if s.expert_layout != "gemma4" or s.experts_unfused:
        block = "" if s.expert_layout == "gemma4" else f"{s.moe_block}."
        where = f"{prefix}{block}experts.0."
        lo, hi = shard.expert_held_range
        gate, up, down = s.expert_names
        if s.expert_layout == "gpt_oss":  # gate and up: the stack's interleaved rows
            where, gate, up = f"{prefix}mlp.experts.", "gate_up_proj", "gate_up_proj"
        out += [(where + gate, (i, h), [((lo, hi), (0, h))]),
                (where + up, (i, h), [((lo, hi), (0, h))]),
                (where + down, (h, i), [((0, h), (lo, hi))])]  # fmt: skip
    if s.shared_expert_size:
        size, (lo, hi) = s.shared_expert_size, shard.shared_expert_range
        where = f"{prefix}mlp.shared_expert."
        out += [(where + "gate_proj", (size, h), [((lo, hi), (0, h))]),
                (where + "up_proj", (size, h), [((lo, hi), (0, h))]),
                (where + "down_proj", (h, size), [((0, h), (lo, hi))])]  # fmt: skip
    return out
