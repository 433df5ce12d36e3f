"""Random PEFT adapters for any model's shapes, one directory each, as a user's would be.

The engine bench's families (a mixture of experts' adapters target every expert) and the
GPU bench's Llama-3.1-8B adapters are written here: A [r, in] and B [out, r] per targeted
module and layer, drawn from one generator per adapter (on the device that makes them
fastest), deltas of LORA_REL of the weights' scale, and the demo's adapter_config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.demo.assets import LORA_REL, DemoSpec, peft_config
from replica.model.hybrid import LINEAR_MODULES
from replica.model.spec import MLP_MODULES, ModelSpec


@dataclass(frozen=True)
class AdapterPlan:
    """One adapter to write: its name, rank, alpha, target modules and scaling rule."""

    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


def adapter_modules(spec: ModelSpec, layer: int, targets: tuple[str, ...]) -> list[tuple]:
    """(PEFT key less .lora_A.weight, in, out) of each target in `layer`; an MLP target
    on a sparse layer is every expert's (the Hub's per-expert 2D keys). On a hybrid model
    an attention target applies to its attention layers, a linear-attention one to its
    Gated DeltaNet layers (as PEFT finds them). Each layer at its own shapes; a k or v
    projection the layer does not have (Gemma 4's KV-sharing layers) is not targeted."""
    shapes, out = spec.layer(layer).module_shapes(), []
    for mod in targets:
        if mod in ("k_proj", "v_proj") and not spec.has_kv_projection(layer, mod):
            continue
        if mod in LINEAR_MODULES or (spec.is_linear(layer) and mod not in MLP_MODULES):
            if mod in LINEAR_MODULES and spec.is_linear(layer):
                out.append((f"base_model.model.model.layers.{layer}.linear_attn.{mod}",
                            *shapes[mod]))  # fmt: skip
        elif mod not in MLP_MODULES:
            out.append((f"base_model.model.model.layers.{layer}.self_attn.{mod}", *shapes[mod]))
        elif not spec.is_sparse(layer):
            out.append((f"base_model.model.model.layers.{layer}.mlp.{mod}", *shapes[mod]))
        else:
            name = spec.expert_names[MLP_MODULES.index(mod)]
            n_in, n_out = spec.expert_shapes()[f"expert_{mod}"]
            block = f"base_model.model.model.layers.{layer}.{spec.moe_block}.experts"
            out += [(f"{block}.{e}.{name}", n_in, n_out) for e in range(spec.num_experts)]
    return out


def adapter_bytes(spec: ModelSpec, plan: AdapterPlan, element_size: int) -> int:
    """Bytes of `plan`'s A and B over every layer, at `element_size` bytes a weight."""
    return sum(
        plan.rank * (n_in + n_out) * element_size
        for layer in range(spec.num_layers)
        for _, n_in, n_out in adapter_modules(spec, layer, plan.targets)
    )


def write_adapters(
    model_dir: Path,
    spec: ModelSpec,
    out: Path,
    plans: list[AdapterPlan],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, Path]:
    """Each plan's adapter of the model at `model_dir` (shapes from `spec`) under
    `out`/name; their directories by name. Deterministic for a seed and device."""
    paths = {}
    for i, plan in enumerate(plans):
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + i)
        tensors = {}
        for layer in range(spec.num_layers):
            for key, n_in, n_out in adapter_modules(spec, layer, plan.targets):
                # weights of std ~1/sqrt(in): std(scaling * B @ A) = LORA_REL / sqrt(in)
                a_std, b_std = n_in**-0.5, LORA_REL / math.sqrt(plan.rank) / plan.scaling
                for part, shape, std in (("A", (plan.rank, n_in), a_std),
                                         ("B", (n_out, plan.rank), b_std)):  # fmt: skip
                    drawn = torch.randn(shape, generator=gen, device=device) * std
                    tensors[f"{key}.lora_{part}.weight"] = drawn.to(dtype).cpu()
        path = out / plan.name
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = peft_config(DemoSpec(), plan.rank, plan.alpha, plan.targets, plan.rslora)
        config["base_model_name_or_path"] = str(model_dir)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        paths[plan.name] = path
    return paths
