"""The linear-attention side of a hybrid model (Qwen3.5/3.6): its shapes and state sizes.

Pure arithmetic on config values, no tensors: what model/spec.py, model/lora.py, the
state pool (model/gated_deltanet.py) and the memory plan share. A Gated DeltaNet layer
projects the hidden state into q, k (num_key_heads × key_head_dim each), v
(num_value_heads × value_head_dim), the output gate z (as v), and per value head b
(write strength) and a (decay); q, k, v pass a causal depthwise conv1d of conv_kernel
taps. Each sequence keeps, per such layer, its conv state (the last conv_kernel - 1
inputs of q, k, v) and its recurrent state ([value heads, key_head_dim, value_head_dim]
fp32): fixed-size, whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The linear-attention projections of a Gated DeltaNet layer, as its checkpoint and
# PEFT name them; in_proj_* share their input (held as one fused group, model/lora.py).
LINEAR_IN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
LINEAR_MODULES = (*LINEAR_IN_MODULES, "out_proj")
LINEAR_ATTENTION = "linear_attention"  # HF's layer_types value of a Gated DeltaNet layer


@dataclass(frozen=True)
class LinearAttentionSpec:
    layers: tuple[int, ...]  # the Gated DeltaNet layers (the others attend, with KV)
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # taps of the causal depthwise conv1d

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv1d runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def module_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear-attention projection."""
        return {
            "in_proj_qkv": (hidden, self.conv_dim),
            "in_proj_z": (hidden, self.value_dim),
            "in_proj_b": (hidden, self.num_value_heads),
            "in_proj_a": (hidden, self.num_value_heads),
            "out_proj": (self.value_dim, hidden),
        }

    def conv_state_shape(self) -> tuple[int, int]:
        """One sequence's conv state in one layer: [conv_dim, conv_kernel - 1]."""
        return self.conv_dim, self.conv_kernel - 1

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One sequence's recurrent state in one layer: [value heads, dk, dv] (fp32)."""
        return self.num_value_heads, self.key_head_dim, self.value_head_dim

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes over every linear-attention layer: the conv
        state in the model's dtype, the recurrent state in fp32."""
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return len(self.layers) * (conv + recurrent)

    def parameters_per_layer(self, hidden: int) -> int:
        """Weights of one Gated DeltaNet layer's mixer (projections, conv taps, decay and
        its bias, the gated norm)."""
        projections = sum(i * o for i, o in self.module_shapes(hidden).values())
        return (projections + self.conv_dim * self.conv_kernel + 2 * self.num_value_heads
                + self.value_head_dim)  # fmt: skip
