"""Gemma 4's per-layer input embeddings (PLE): a second, narrow input per layer.

Each token gets `width` extra inputs per layer: its row of a packed embedding
[per_layer_vocab, layers · width] (times sqrt(width)) plus a projection of its input
embedding (times hidden^-0.5, RMS-normed per layer), the two summed and halved in
variance (· 2^-0.5). After its MLP, layer i adds
norm(proj(gelu(gate(x)) · input_i)) to the residual stream (transformers'
Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs and the decoder layer's
per_layer_input_gate / per_layer_projection). The three projections are held dense or
packed as a quantized checkpoint stores them (replicated on every rank), their LoRA on
the unquantized input.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import SegmentInfo
from replica.model.layout import CheckpointLayout
from replica.model.lora import LoRABuffers, LoRALinear, LoRAWorkspace, linear
from replica.model.quant_weights import fused_weight, on_device, tensors_of
from replica.model.spec import ModelSpec

# The family's RMSNorm of a weight (the decoder's spec_norm: Gemma 4's x̂·w in fp32)
NormOf = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


class PerLayerInputs:
    """The model-level half: a step's [T, layers, width] per-layer inputs."""

    def __init__(
        self,
        spec: ModelSpec,
        layout: CheckpointLayout,
        device: torch.device,
        dtype: torch.dtype,
        norm: NormOf,
    ) -> None:
        h, n, w = spec.hidden_size, spec.num_layers, spec.per_layer_input_size
        self.layers, self.width = n, w

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return layout.tensor(None, name, shape).to(device=device, dtype=dtype)

        self.embed = get("embed_tokens_per_layer.weight", (spec.per_layer_vocab_size, n * w))
        projection = layout.replicated_linear(None, "per_layer_model_projection", (n * w, h))
        self.projection = fused_weight([on_device(projection, device, dtype)])
        self.norm = norm(get("per_layer_projection_norm.weight", (w,)))
        # transformers rounds sqrt(width) to the weights' dtype, as the main embedding's
        self.embed_scale = torch.tensor(math.sqrt(w)).to(device, dtype)
        self.projection_scale = h**-0.5

    def weights(self) -> list[torch.Tensor]:
        """The tensors a step reads in full (the embedding is gathered by row)."""
        return tensors_of(self.projection) + [self.norm.weight]

    def __call__(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """input_ids [T] and their scaled input embeddings [T, hidden] -> [T, layers, width]."""
        t = input_ids.shape[0]
        tokens = (F.embedding(input_ids, self.embed) * self.embed_scale).view(t, self.layers, -1)
        proj = linear(embeds, self.projection) * self.projection_scale
        proj = self.norm(proj.view(t, self.layers, self.width))
        return (proj + tokens) * 2.0**-0.5


class PerLayerInputBlock:
    """The layer-level half: what layer `index` adds to its residual stream."""

    def __init__(
        self,
        spec: ModelSpec,
        layout: CheckpointLayout,
        index: int,
        lora: dict[str, LoRABuffers] | None,  # the layer's arenas
        device: torch.device,
        dtype: torch.dtype,
        norm: NormOf,
    ) -> None:
        h, w = spec.hidden_size, spec.per_layer_input_size

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return layout.tensor(index, name, shape).to(device=device, dtype=dtype)

        def lora_linear(module: str, shape: tuple[int, int]) -> LoRALinear:
            w = on_device(layout.replicated_linear(index, module, shape), device, dtype)
            return LoRALinear(fused_weight([w]), None, bufs.get(module))

        bufs = lora or {}
        self.gate = lora_linear("per_layer_input_gate", (w, h))
        self.projection = lora_linear("per_layer_projection", (h, w))
        self.norm = norm(get("post_per_layer_input_norm.weight", (h,)))

    def weights(self) -> list[torch.Tensor]:
        return (
            tensors_of(self.gate.weight) + tensors_of(self.projection.weight) + [self.norm.weight]
        )

    def __call__(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor,
        lora: dict[str, SegmentInfo],
        ws: LoRAWorkspace | None,
    ) -> torch.Tensor:
        """x [T, hidden] (the layer's output so far), this layer's inputs [T, width], the
        step's LoRA segments -> the [T, hidden] to add."""
        gate = self.gate(x, lora.get("per_layer_input_gate"), ws)
        g = F.gelu(gate, approximate="tanh") * per_layer_input
        out = self.projection(g, lora.get("per_layer_projection"), ws)
        return self.norm(out)
