"""The one factory of the tests' engines, the prompts they feed them, and the bytes a
built model holds."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cluster.demo.assets import DemoAssets
from replica.adapters.sources import AdapterSource
from replica.config import AdapterResidencyConfig, EngineConfig
from replica.engine.engine import LLMEngine
from replica.model.decoder import CausalLM

ALL = None  # make_engine's adapters: every adapter of the assets
RESIDENCY_KEYS = frozenset(AdapterResidencyConfig.model_fields)


def make_engine(
    model: DemoAssets | str | Path,
    adapters: Mapping[str, str | Path] | None = ALL,
    *,
    source: AdapterSource | None = None,
    **config: Any,
) -> LLMEngine:
    """Return an LLMEngine on `model` (demo assets, anything with their `model_dir` and
    `adapters`, or a model directory) with `adapters` loaded (name -> PEFT directory;
    default: all of the assets' adapters, none for a bare directory) and `config`'s
    EngineConfig fields.

    One place builds the tests' engines, so a test states only the settings it depends on
    and a change of EngineConfig is made once. Defaults: CPU, a 16 MiB KV cache, and one
    slot per adapter beside the base's (no memory sizing, no eviction unless asked for).
    """
    if adapters is ALL:
        adapters = getattr(model, "adapters", {})
    model_dir = getattr(model, "model_dir", model)
    config.setdefault("device", "cpu")
    config.setdefault("kv_cache_bytes", 16 << 20)
    if adapters and "num_slots" not in config and "adapter_memory_bytes" not in config:
        config["num_slots"] = len(adapters) + 1
    # the residency knobs go where EngineConfig keeps them (engine.adapters), not by their
    # deprecated flat names
    residency = {k: config.pop(k) for k in list(config) if k in RESIDENCY_KEYS}
    if residency:
        config["adapters"] = residency
    engine = LLMEngine(EngineConfig(model=str(model_dir), **config), source)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def tokens(seed: int, n: int, vocab: int = 300) -> list[int]:
    """Return `n` token ids drawn from [3, vocab) by a generator seeded with `seed`."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def held_bytes(model: CausalLM) -> int:
    """Return the bytes of every distinct tensor `model` holds."""
    tensors = {id(t): t for t in (model.embed, model.lm_head, model.norm.weight)}
    if model.per_layer_inputs is not None:  # Gemma 4
        ple = model.per_layer_inputs
        tensors |= {id(t): t for t in [ple.embed, *ple.weights()]}
    for layer in model.layers:
        extra = [layer.rope.cos, layer.rope.sin, layer.sinks, layer.scalar]
        if layer.linear_attn is None:  # attention's biases (a Gated DeltaNet has none)
            extra += [layer.qkv_proj.bias, layer.o_proj.bias]
        tensors |= {id(t): t for t in [*layer.weights(), *extra] if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())
