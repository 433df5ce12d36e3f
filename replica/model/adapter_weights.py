"""PEFT LoRA directory -> engine layout. The one conversion every adapter source uses.

Engine layout: per layer, per target module, A `[r, in]` and B `[out, r]`,
plus one scaling per adapter (alpha/r, or alpha/sqrt(r) for rsLoRA).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from replica.model.spec import ModelSpec

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


# (module, A [r, in], B [out, r]) -> the part of (A, B) to keep, as views: how a
# tensor-parallel rank keeps only its shard (TPShard.slice_lora).
SelectLoRA = Callable[[str, Any, Any], tuple[Any, Any]]


class AdapterFormatError(ValueError):
    """An adapter directory is malformed or does not fit the base model."""


@dataclass
class LoRAAdapterWeights:
    """A converted adapter, ready to be copied into a device slot."""

    name: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, module) -> (A [r, in], B [out, r]); modules the adapter does not target are absent
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def select(self, select: SelectLoRA) -> LoRAAdapterWeights:
        """A copy keeping only the part `select` picks of each module's weights (the
        rest is not referenced afterwards, so it can be freed)."""
        weights = {}
        for (layer, module), (a, b) in self.weights.items():
            a, b = select(module, a, b)
            weights[(layer, module)] = (_own(a), _own(b))
        return LoRAAdapterWeights(self.name, self.rank, self.scaling, self.target_modules, weights)


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def load_peft_adapter(
    path: str | Path, spec: ModelSpec, max_lora_rank: int, name: str | None = None
) -> LoRAAdapterWeights:
    """Read and validate a PEFT LoRA directory against `spec`; raise AdapterFormatError."""
    path = Path(path)
    config = _read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterFormatError(f"{path}: missing adapter_model.safetensors")
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise AdapterFormatError(f"{weights_file}: unreadable safetensors file ({e})") from None
    return convert_peft_tensors(name or path.name, config, tensors, spec, max_lora_rank)


def convert_peft_tensors(
    name: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    spec: ModelSpec,
    max_lora_rank: int,
) -> LoRAAdapterWeights:
    """Validate PEFT config + tensors and regroup them per (layer, module)."""
    _check_config(name, config)
    rank = int(config["r"])
    if rank > max_lora_rank:
        raise AdapterFormatError(f"{name}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterFormatError(f"{name}: unsupported tensor {key!r}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise AdapterFormatError(
                f"{name}: tensor {key!r} targets layer {layer}, model has {spec.num_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterFormatError(f"{name}: adapter_model.safetensors holds no LoRA weights")
    shapes = spec.module_shapes()
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterFormatError(f"{name}: layer {layer} {module} lacks lora_{missing}")
        in_f, out_f = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise AdapterFormatError(
                f"{name}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)}, expected ({rank}, {in_f}) / ({out_f}, {rank}) "
                "for this base model"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterFormatError(f"{name}: layer {layer} {module}: non-float weights")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            # one NaN would poison every sequence batched with this adapter's slot row
            raise AdapterFormatError(f"{name}: layer {layer} {module}: NaN or infinite weights")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterFormatError(f"{name}: lora_alpha={alpha!r} is not a finite number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = tuple(m for m in TARGETABLE if any(k[1] == m for k in weights))
    return LoRAAdapterWeights(name, rank, scaling, modules, weights)


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterFormatError(f"{path}: not a directory")
    if not cfg_file.is_file():
        raise AdapterFormatError(f"{path}: missing adapter_config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except UnicodeDecodeError:
        raise AdapterFormatError(f"{cfg_file}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise AdapterFormatError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{cfg_file}: expected a JSON object")
    return config


def _check_config(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"{name}: peft_type {config.get('peft_type')!r} is not LORA")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        raise AdapterFormatError(f"{name}: adapter_config.json r={r!r} is not a positive integer")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "layer_replication": "layer_replication",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterFormatError(f"{name}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"{name}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterFormatError(f"{name}: fan_in_fan_out=true is not supported")
