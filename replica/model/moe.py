"""A sparse (mixture-of-experts) MLP: router, experts grouped by expert, expert LoRA.

Router: logits x·Wrᵀ (+ its bias: gpt-oss) in the model's dtype, softmax over every
expert in fp32, the top k, renormalised to sum 1 when the spec says so (Mixtral always,
Qwen3-MoE with norm_topk_prob; gpt-oss's softmax over the top k logits is the same),
rounded to the model's dtype. Experts: the T*k (token, expert) pairs
are sorted by expert and, within one, by sequence (kernels.make_expert_plan, device ops
only), so one grouped GEMM per projection reads each expert's stacked weights
([E, 2I, H] gate and up, [E, H, I] down) once. Expert LoRA is added where vLLM and
SGLang add it: gate/up LoRA to the first GEMM's output before the activation, down LoRA
to each expert's output before the weighted sum over the k experts; both run as the
ordinary multi-LoRA ops over (adapter, expert) groups of the same sort
(kernels.expert_lora_shrink / expert_lora_expand): an adapter's expert e rows sit in
expert e's block of the expert arenas. gpt-oss's experts add a bias to each (expert's)
gate/up and down output, gathered per sorted pair by its expert, and apply the clamped
SwiGLU (decoder.gated_activation). Qwen3.5-MoE adds a shared expert every token runs
through, its output times sigmoid(shared_expert_gate(x)) (its projections dense or
packed as the checkpoint stores them; LoRA on it is refused at load). Nothing here
reads a device value, so the decode step stays graph-safe.

Tensor parallelism: each rank holds every expert's share of the intermediate columns
(gate/up rows, down columns), LoRA split the same way (gate/up B by rows; down A by
columns, its [P, r] intermediate all-reduced, B by the rank's hidden columns); the
weighted sum is all-reduced once, as the dense MLP's down projection is. Gate/up biases
are split with their rows; the down bias is added on rank 0 only, so the all-reduce
counts it once. gpt-oss's MXFP4 experts hold whole groups of 32 columns
(TPShard.expert_held_range): the columns a rank borrows have zero gate/up rows, biases
and LoRA B rows, so their clamped SwiGLU is exactly 0 and adds nothing to the rank's sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import kernels
from kernels import ExpertPlan, QuantizedWeight, SegmentInfo
from replica.model.layout import CheckpointLayout
from replica.model.lora import EXPERT_GROUPS, LoRABuffers, LoRAWorkspace, linear
from replica.model.quant_weights import (
    PackedLinear,
    fused_weight,
    on_device,
    tensors_of,
    to_device,
)
from replica.model.spec import ModelSpec
from replica.model.tp_layers import TPRank


class SparseMoE:
    def __init__(
        self,
        spec: ModelSpec,  # this rank's shapes
        layout: CheckpointLayout,
        index: int,
        lora: dict[str, LoRABuffers],  # the layer's arenas; the expert groups if any
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (gate, up) -> hidden
        device: torch.device,
        dtype: torch.dtype,
        tp: TPRank | None = None,
    ) -> None:
        self.num_experts, self.k = spec.num_experts, spec.num_experts_per_tok
        self.renormalise, self.glu = spec.norm_topk_prob, glu
        self.router = layout.router(index).to(device=device, dtype=dtype)  # [E, H]
        experts = layout.experts(index)
        self.packed: tuple[QuantizedWeight, ...] = ()
        if isinstance(experts[0], torch.Tensor):
            self.gate_up = experts[0].to(device=device, dtype=dtype)  # [E, 2I, H]
            self.down = experts[1].to(device=device, dtype=dtype)  # [E, H, I]
        else:  # packed gate [E, I, H], up [E, I, H], down [E, H, I]: quant_moe_gemm
            self.packed = tuple(to_device(w, device) for w in experts)
        # gpt-oss: the router's [E] bias, each expert's gate/up [E, 2I] and down [E, H] ones
        self.router_bias = self.gate_up_bias = self.down_bias = None
        if spec.moe_bias:
            self.router_bias = layout.router(index, "bias").to(device=device, dtype=dtype)
            gate_up_b, down_b = layout.expert_biases(index)
            self.gate_up_bias = gate_up_b.to(device=device, dtype=dtype)
            if tp is None or tp.shard.rank == 0:  # summed over ranks by the all-reduce
                self.down_bias = down_b.to(device=device, dtype=dtype)
        # Qwen3.5-MoE: (gate/up [2S, H], down [H, S], each dense or packed; its gate [1, H])
        self.shared: tuple[torch.Tensor | PackedLinear, torch.Tensor | PackedLinear,
                           torch.Tensor] | None = None  # fmt: skip
        if spec.shared_expert_size:
            gate, up, down, shared_gate = (
                on_device(w, device, dtype) for w in layout.shared_expert(index)
            )
            self.shared = (fused_weight([gate, up]), fused_weight([down]), shared_gate)
        self.lora = {g: lora[g] for g in EXPERT_GROUPS if g in lora}
        self.comm = None if tp is None else tp.comm
        self.cols = slice(None) if tp is None else slice(*tp.shard.hidden_range)

    def weights(self) -> list[torch.Tensor]:
        biases = [b for b in (self.router_bias, self.gate_up_bias, self.down_bias) if b is not None]
        biases += [t for w in self.shared or () for t in tensors_of(w)]
        if self.packed:
            return [self.router] + [t for w in self.packed for t in tensors_of(w)] + biases
        return [self.router, self.gate_up, self.down] + biases

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] weights in x's dtype, [T, k] int64 expert ids) of each token."""
        probs = torch.softmax(F.linear(x, self.router, self.router_bias).float(), dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        lora: dict[str, SegmentInfo],
        ws: LoRAWorkspace | None = None,  # unused: expert LoRA's rows are pairs, not tokens
        route_from: torch.Tensor | None = None,  # what the router reads, when not x (Gemma 4)
    ) -> torch.Tensor:  # [T, H]
        t, h = x.shape
        weights, ids = self.route(x if route_from is None else route_from)
        seg = lora.get("experts_gate_up", lora["qkv_proj"])  # the step's segments
        plan = kernels.make_expert_plan(ids, self.num_experts, seg)
        xs = x.index_select(0, plan.tokens)  # [P, H]: each pair's input, sorted
        gate_up = self._gate_up(xs, plan)  # [P, 2I]
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias.index_select(0, plan.experts)
        self._add_lora("experts_gate_up", xs, gate_up, lora, plan)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.glu(gate, up)  # [P, I]
        if self.packed:
            out = kernels.quant_moe_gemm(hidden, self.packed[2], plan)  # [P, H]
        else:
            out = kernels.moe_grouped_gemm(hidden, self.down, plan)  # [P, H]
        if self.down_bias is not None:
            out += self.down_bias.index_select(0, plan.experts)
        self._add_lora("experts_down", hidden, out, lora, plan)
        out = out * weights.reshape(-1).index_select(0, plan.order)[:, None]
        y = torch.empty_like(out).index_copy_(0, plan.order, out)  # back to (token, j) order
        y = y.view(t, self.k, h).sum(dim=1)
        if self.shared is not None:
            y = y + self._shared_expert(x)
        return y if self.comm is None else self.comm.all_reduce(y, "layer")

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        """sigmoid(x·gᵀ) · down(glu(gate(x), up(x))): on a rank, its columns' partial sum
        (the layer's all-reduce adds the ranks' parts)."""
        gate_up, down, gate = self.shared
        g, u = linear(x, gate_up).chunk(2, dim=-1)
        return torch.sigmoid(F.linear(x, gate)) * linear(self.glu(g, u), down)

    def _gate_up(self, xs: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:  # [P, 2I]
        if not self.packed:
            return kernels.moe_grouped_gemm(xs, self.gate_up, plan)
        gate, up = (kernels.quant_moe_gemm(xs, w, plan) for w in self.packed[:2])
        return torch.cat([gate, up], dim=-1)

    def _add_lora(
        self,
        group: str,
        x: torch.Tensor,  # [P, in], sorted
        y: torch.Tensor,  # [P, out], sorted, updated in place
        lora: dict[str, SegmentInfo],
        plan: ExpertPlan,
    ) -> None:
        buf, seg = self.lora.get(group), lora.get(group)
        if buf is None or seg is None or not seg.has_lora:
            return
        inter = kernels.expert_lora_shrink(x, buf.a, plan, seg, buf.max_rank)
        if group == "experts_gate_up":
            kernels.expert_lora_expand(y, inter, buf.b, plan, seg, buf.slice_offsets)
            return
        if self.comm is not None:  # down: A split by input columns, a partial sum
            self.comm.all_reduce(inter, "lora")
        kernels.expert_lora_expand(y[:, self.cols], inter, buf.b, plan, seg, buf.slice_offsets)
