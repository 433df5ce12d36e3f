"""Gemma 4's MoE block: experts beside the dense MLP, routed from the residual stream.

transformers' Gemma4TextDecoderLayer with enable_moe_block: after attention, the residual
r feeds both the dense MLP (its pre_feedforward_layernorm, then post_feedforward_layernorm_1)
and the experts (pre_feedforward_layernorm_2, then post_feedforward_layernorm_2); the two
are summed before post_feedforward_layernorm. The router reads r itself: RMS-normed without
weight, times its `scale` [hidden] and hidden^-0.5, projected to the experts' logits; the
softmax's top k renormalised to sum 1, then each times its expert's `per_expert_scale`.
The experts are model/moe.py's (stacked gate/up [E, 2I, hidden], down [E, hidden, I],
act(gate)·up), their LoRA included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import SegmentInfo
from replica.model.layout import CheckpointLayout
from replica.model.lora import LoRABuffers, LoRAWorkspace
from replica.model.moe import SparseMoE
from replica.model.spec import ModelSpec
from replica.model.tp_layers import TPRank


class Gemma4Experts(SparseMoE):
    """The experts half of the block, with Gemma 4's router (call with route_from=r)."""

    def __init__(
        self,
        spec: ModelSpec,
        layout: CheckpointLayout,
        index: int,
        lora: dict[str, LoRABuffers],
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        tp: TPRank | None = None,
    ) -> None:
        super().__init__(spec, layout, index, lora, glu, device, dtype, tp)
        h, e = spec.hidden_size, spec.num_experts
        self.scale = layout.tensor(index, "router.scale", (h,)).to(device=device, dtype=dtype)
        per_expert = layout.tensor(index, "router.per_expert_scale", (e,))
        self.per_expert_scale = per_expert.to(device=device, dtype=dtype)
        self.root, self.eps = h**-0.5, spec.rms_norm_eps

    def weights(self) -> list[torch.Tensor]:
        return super().weights() + [self.scale, self.per_expert_scale]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] weights in x's dtype, [T, k] int64 expert ids) of each token of the
        residual stream `x`."""
        h = x.float()
        h = (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        logits = F.linear(h * self.scale * self.root, self.router)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[ids]).to(x.dtype), ids


def moe_beside_mlp(
    mlp_out: torch.Tensor,  # the dense MLP's output
    residual: torch.Tensor,
    experts: Gemma4Experts,
    norms: tuple,  # post_feedforward_layernorm_1, pre_feedforward_layernorm_2, ..._2
    lora: dict[str, SegmentInfo],
    ws: LoRAWorkspace | None,
) -> torch.Tensor:
    """The dense MLP's output and the experts' summed, each normed (before the layer's
    post_feedforward_layernorm)."""
    post_mlp, pre_experts, post_experts = norms
    out = experts(pre_experts(residual), lora, ws, route_from=residual)
    return post_mlp(mlp_out) + post_experts(out)
