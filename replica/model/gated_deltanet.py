"""Gated DeltaNet, the linear attention of Qwen3.5/3.6's hybrid layers, and the
per-sequence state it keeps.

A Gated DeltaNet layer keeps no KV: each sequence carries, per such layer, a conv state
and a recurrent state of fixed size (model/hybrid.py). The StatePool holds them for every
sequence the engine may run at once, one row per state slot (engine/state_slots.py hands
a slot to a sequence when it is admitted and takes it back when it ends), plus a scratch
row for padding rows: fixed addresses, so a captured decode graph reads and writes the
same tensors every replay. The ops are kernels.causal_conv1d and kernels.gated_delta_rule
over the step's kernels.StateBatch: a prefill chunk starts from its slot's state unless it
is the sequence's first, a decode takes the recurrent update.

    y = in_proj(x): qkv [conv_dim], z [value_dim], b, a [value heads]   (one GEMM + LoRA)
    q, k, v = split(silu(causal_conv1d(qkv)))
    o = gated_delta_rule(q, k, v, g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b))
    out = out_proj(rmsnorm(o)·w · silu(z))                                (per value head)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from kernels import QuantizedWeight, SegmentInfo, StateBatch
from replica.model.hybrid import LINEAR_IN_MODULES, LinearAttentionSpec
from replica.model.layout import CheckpointLayout
from replica.model.lora import LoRABuffers, LoRALinear, LoRAWorkspace
from replica.model.quant_weights import PackedLinear, fused_weight, on_device, tensors_of
from replica.model.spec import ModelSpec
from replica.model.tp_layers import RowParallelLoRALinear, TPRank


class StatePool:
    """conv[layer]: [num_slots, conv_dim, conv_kernel - 1] in the model's dtype, and
    recurrent[layer]: [num_slots, value heads, dk, dv] fp32, for each linear-attention
    layer (None for the others). Rows are written only by the sequence whose slot they
    are; a sequence's first chunk never reads its row, so rows need no clearing."""

    def __init__(
        self,
        linear: LinearAttentionSpec,
        num_layers: int,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        conv, recurrent = linear.conv_state_shape(), linear.recurrent_state_shape()
        self.conv: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent: list[torch.Tensor | None] = [None] * num_layers
        for i in linear.layers:
            self.conv[i] = torch.zeros((num_slots, *conv), device=device, dtype=dtype)
            self.recurrent[i] = torch.zeros(
                (num_slots, *recurrent), device=device, dtype=torch.float32
            )
        self.num_slots = num_slots

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Slot src[i]'s state into slot dst[i], in every layer (a forked choice starts
        from its parent's state), in stream order, without a host read."""
        if not src:
            return
        for pool in (*self.conv, *self.recurrent):
            if pool is not None:
                pool[dst] = pool[src]


class GatedRMSNorm:
    """Per value head: w · (x / rms(x)) rounded to x's dtype, times silu(z) in fp32, rounded
    once (transformers' Qwen3_5RMSNormGated: w·x̂, not Qwen3.5's other norms' x̂·(1+w))."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet:
    """One Gated DeltaNet layer's token mixer: (normed hidden states, the step's state
    batch, its pools) -> the layer's attention-branch output [T, hidden]."""

    def __init__(
        self,
        linear: LinearAttentionSpec,
        # [conv_dim + value_dim + 2·HV, hidden]: qkv, z, b, a rows, dense or packed parts
        in_weight: torch.Tensor | PackedLinear,
        # [hidden, value_dim] (dense or packed), or its TP rank's row-parallel layer
        out_proj: torch.Tensor | PackedLinear | RowParallelLoRALinear,
        conv_weight: torch.Tensor,  # [conv_dim, conv_kernel]
        a_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        norm_weight: torch.Tensor,  # [value_head_dim]
        eps: float,
        bufs: dict[str, LoRABuffers],
    ) -> None:
        self.linear = linear
        self.in_proj = LoRALinear(in_weight, None, bufs.get("in_proj"))
        if not isinstance(out_proj, RowParallelLoRALinear):
            out_proj = LoRALinear(out_proj, None, bufs.get("out_proj"))
        self.out_proj = out_proj
        self.conv_weight, self.dt_bias = conv_weight, dt_bias
        # the decay rate -exp(A_log) in fp32, as transformers computes it from the stored
        # A_log: once here rather than three kernels per layer every step
        self.neg_decay_rate = -a_log.float().exp()
        self.norm = GatedRMSNorm(norm_weight, eps)

    def weights(self) -> list[torch.Tensor]:
        small = [self.conv_weight, self.neg_decay_rate, self.dt_bias, self.norm.weight]
        return tensors_of(self.in_proj.weight) + tensors_of(self.out_proj.weight) + small

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]: the input norm's output
        lora: dict[str, SegmentInfo],
        ws: LoRAWorkspace | None,
        states: StateBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        s, t = self.linear, x.shape[0]
        hv, dk, dv = s.num_value_heads, s.key_head_dim, s.value_head_dim
        y = self.in_proj(x, lora["in_proj"], ws)
        qkv, z, b, a = y.split([s.conv_dim, s.value_dim, hv, hv], dim=1)
        qkv = kernels.causal_conv1d(qkv, self.conv_weight, None, conv_state, states, "silu")
        q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=1)
        beta = b.sigmoid()
        g = self.neg_decay_rate * F.softplus(a.float() + self.dt_bias)
        o = kernels.gated_delta_rule(
            q.view(t, s.num_key_heads, dk), k.view(t, s.num_key_heads, dk),
            v.view(t, hv, dv), g, beta, recurrent_state, states,
        )  # fmt: skip
        o = self.norm(o, z.view(t, hv, dv))
        return self.out_proj(o.reshape(t, s.value_dim), lora["out_proj"], ws)


def gated_deltanet(
    spec: ModelSpec,
    layout: CheckpointLayout,
    index: int,
    bufs: dict[str, LoRABuffers],
    device: torch.device,
    dtype: torch.dtype,
    tp: TPRank | None = None,
) -> GatedDeltaNet:
    """Layer `index`'s Gated DeltaNet from the checkpoint (its linear_attn.* tensors), each
    projection dense or packed as the checkpoint stores it (a quantized one multiplies
    through kernels.quant_linear, its LoRA on the unquantized input); `spec`: this rank's
    shapes (its heads under tensor parallelism, out_proj then row-parallel)."""
    linear, whole = spec.linear_attention, layout.spec.linear_attention
    assert linear is not None and whole is not None

    def load(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return layout.layer_tensor(index, f"linear_attn.{name}", shape).to(device, dtype)

    def held(module: str) -> list[torch.Tensor | QuantizedWeight]:
        return [on_device(w, device, dtype) for w in layout.row_parts(index, module)]

    hv = whole.num_value_heads
    out = fused_weight(held("out_proj"))
    return GatedDeltaNet(
        linear,
        fused_weight([w for m in LINEAR_IN_MODULES for w in held(m)]),
        out if tp is None else tp.row_linear(out, bufs.get("out_proj")),
        load("conv1d.weight", (whole.conv_dim, 1, whole.conv_kernel))[:, 0].contiguous(),
        load("A_log", (hv,)),
        load("dt_bias", (hv,)),
        load("norm.weight", (whole.value_head_dim,)),
        spec.rms_norm_eps,
        bufs,
    )
