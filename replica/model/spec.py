"""The model's shape, read from a Hugging Face config.json (Llama family only)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model directory cannot be served by this implementation."""


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 layout: q/k/v projections carry a bias, o does not
    sliding_window: int | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Weights the model holds (projections, embeddings, head, norms; biases aside)."""
        projections = sum(i * o for i, o in self.module_shapes().values())
        norms = (2 * self.num_layers + 1) * self.hidden_size
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * projections + heads * self.vocab_size * self.hidden_size + norms

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: no config.json (expected a Hugging Face model directory)")
    spec = spec_from_dict(json.loads(path.read_text()), source=str(path))
    # generation_config.json may name more end-of-turn ids (Llama-3 Instruct's <|eot_id|>
    # lives only there): they end generation too
    extra = _as_tuple(read_generation_config(model_dir).get("eos_token_id"))
    eos = spec.eos_token_ids + tuple(t for t in extra if t not in spec.eos_token_ids)
    return replace(spec, eos_token_ids=eos)


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The model directory's generation_config.json ({} when absent or unreadable: it is
    optional, and a broken one must not stop the model from serving)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def spec_from_dict(cfg: dict[str, Any], source: str = "config") -> ModelSpec:
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelConfigError(
            f"{source}: unsupported architecture model_type={arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: unsupported hidden_act={cfg['hidden_act']!r}")
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        spec = ModelSpec(
            arch=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg, source),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ModelConfigError(
            f"{source}: num_attention_heads={spec.num_heads} is not a multiple of "
            f"num_key_value_heads={spec.num_kv_heads}"
        )
    if cfg.get("attention_bias") and arch != "qwen2":
        raise ModelConfigError(f"{source}: attention_bias=true (o_proj bias) is not supported")
    return spec


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters; older files write rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    return params or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: dict[str, Any], source: str) -> dict[str, Any] | None:
    scaling = dict(_rope_params(cfg) or cfg.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported rope_type={rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
