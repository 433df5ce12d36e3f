"""LoRA-aware projections: base output, then shrink, then expand into it.

Projections are fused where they share an input (q/k/v, gate/up): one base
GEMM, one shrink over A's stacked along the rank axis, one multi-slice expand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels import SegmentInfo
from replica.model.hybrid import LINEAR_IN_MODULES
from replica.model.quant_weights import PackedLinear
from replica.model.spec import ModelSpec


def linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias=None) -> torch.Tensor:
    """x · Wᵀ (+ bias) for a dense or packed base weight (a packed one dequantizes in
    its own kernel)."""
    if isinstance(weight, torch.Tensor):
        return torch.nn.functional.linear(x, weight, bias)
    return weight(x, bias)


# Fused projection groups of one decoder layer, in the order their outputs are laid out.
MODULE_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# A Gated DeltaNet layer's groups (hybrid models): its four input projections share their
# input, held fused as attention's q/k/v are.
LINEAR_GROUPS: dict[str, tuple[str, ...]] = {
    "in_proj": LINEAR_IN_MODULES,
    "out_proj": ("out_proj",),
}
# A sparse layer's expert groups (replica/model/moe.py): one adapter's rows of expert e
# sit in expert e's block of rows of these arenas ([num_slices, E * rows, in], [out, E *
# rows]); the slices are the experts' gate/up and down projections.
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "experts_gate_up": ("expert_gate_proj", "expert_up_proj"),
    "experts_down": ("expert_down_proj",),
}


def layer_groups(spec: ModelSpec, layer: int, *, experts: bool) -> dict[str, tuple[str, ...]]:
    """The projection groups of `layer` with their slices: attention, then the dense
    MLP's, or on a sparse layer its experts' (with `experts`, engine.lora_experts: their
    arenas are most of an MoE model's adapter memory, so they exist only when asked for).
    A checkpoint's fused projection (Phi-3's qkv_proj, gate_up_proj) is one slice, as its
    adapters target it: A stored and read once. Held split, each part would hold the
    whole A (`lorafleet bench kernels --fused` measured that at 1.67x the qkv LoRA time,
    1.24x gate_up's, on Phi-3-mini shapes).
    The qkv group holds only the projections the layer has (ModelSpec.qkv_modules:
    q_proj alone on Gemma 4's KV-sharing layers), as its base weight does."""
    fused = spec.fused_modules()

    def slices(group: str) -> tuple[str, ...]:
        return (group,) if group in fused else MODULE_GROUPS[group]

    groups = {g: slices(g) for g in ("qkv_proj", "o_proj")}
    if "qkv_proj" not in fused:
        groups["qkv_proj"] = spec.qkv_modules(layer)
    if spec.is_linear(layer):
        groups = dict(LINEAR_GROUPS)
    if spec.per_layer_input_size:
        groups |= PER_LAYER_INPUT_GROUPS
    dense = {g: slices(g) for g in ("gate_up_proj", "down_proj")}
    if spec.is_sparse(layer):  # Gemma 4's experts run beside a dense MLP
        expert = EXPERT_GROUPS if experts else {}
        return groups | (dense if spec.moe_beside_mlp else {}) | expert
    return groups | dense


def workspace_columns(spec: ModelSpec, max_rank: int) -> int:
    """The columns of a step's LoRAWorkspace: num_slices x max_rank for every projection
    group of every layer, as LoRASlotBuffers assigns them (expert groups have none: their
    rows are (token, expert) pairs). Layers differ: Gemma 4's KV-sharing layers have one
    qkv slice, a hybrid model's linear-attention layers their own groups."""
    return max_rank * sum(
        len(names)
        for layer in range(spec.num_layers)
        for names in layer_groups(spec, layer, experts=False).values()
    )


# Gemma 4's per-layer-input gate and projection: a group each, on every layer (replicated
# under tensor parallelism, their LoRA whole on every rank).
PER_LAYER_INPUT_GROUPS: dict[str, tuple[str, ...]] = {
    "per_layer_input_gate": ("per_layer_input_gate",),
    "per_layer_projection": ("per_layer_projection",),
}


# The vocabulary modules, model-level groups of one slice (with engine.lora_embeddings):
# the embedding's A is read by token id (kernels.lora_embedding_shrink), the head's rows
# are the logit rows.
VOCAB_GROUPS: dict[str, tuple[str, ...]] = {
    "embed_tokens": ("embed_tokens",),
    "lm_head": ("lm_head",),
}


@dataclass
class LoRABuffers:
    """The adapter weight arenas of one (fused) projection in one layer."""

    a: torch.Tensor  # [num_slices, P, in]: an adapter's slice-j A in rows [o, o + rank) of a[j]
    b: torch.Tensor  # [out_total, P]: its B in columns [o, o + rank); slice j's outputs
    # in rows [offsets[j], offsets[j+1])
    slice_offsets: list[int]  # [num_slices+1] host ints: output column range per slice
    slice_names: tuple[str, ...]  # module names of the slices, e.g. ("q_proj", "k_proj", "v_proj")
    max_rank: int  # R: the intermediate's columns per slice
    workspace_col: int = 0  # first column of this projection's intermediate in a LoRAWorkspace

    @property
    def num_slices(self) -> int:
        return len(self.slice_names)

    @property
    def width(self) -> int:
        """Columns of this projection's intermediate: num_slices * R."""
        return self.num_slices * self.max_rank


class LoRAWorkspace:
    """One step's LoRA intermediates: a single zeroed fp32 allocation for every projection
    of every layer (not one allocation and zero fill per op), a contiguous [T, width]
    region each, at the columns LoRASlotBuffers assigned."""

    def __init__(self, num_tokens: int, num_cols: int, device: torch.device) -> None:
        self.num_tokens = num_tokens
        self.flat = torch.zeros(num_tokens * num_cols, dtype=torch.float32, device=device)

    def region(self, lora: LoRABuffers) -> torch.Tensor:  # [T, num_slices*R], zeros
        t, width = self.num_tokens, lora.width
        return self.flat[lora.workspace_col * t : (lora.workspace_col + width) * t].view(t, width)


class LoRALinear:
    """y = x Wᵀ (+ bias) + per-segment scaling · (x Aᵀ) Bᵀ. W dense, or packed
    (model/quant_weights.py): the adapter then runs on the unquantized x and adds to the
    quantized base's output, exact on every base format."""

    def __init__(
        self,
        weight: torch.Tensor | PackedLinear,  # [out_total, in]
        bias: torch.Tensor | None,  # [out_total]
        lora: LoRABuffers | None,
    ) -> None:
        self.weight, self.bias, self.lora = weight, bias, lora

    def __call__(
        self, x: torch.Tensor, seg: SegmentInfo, workspace: LoRAWorkspace | None = None
    ) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora is not None and seg.has_lora:
            out = None if workspace is None else workspace.region(self.lora)
            inter = kernels.lora_shrink(x, self.lora.a, seg, self.lora.max_rank, out=out)
            kernels.lora_expand(y, inter, self.lora.b, seg, self.lora.slice_offsets)
        return y
