"""Values of a Hugging Face config.json that several modules read: rope parameters (in
either the transformers 4 or 5 spelling), layer types, and the error that names what
cannot be served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


class ModelConfigError(ValueError):
    """The model directory cannot be served by this implementation."""


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: dict[str, Any] | None  # None: default rope; else rope_type and its parameters


def rope_params(cfg: dict[str, Any], layer_type: str = FULL) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters (per layer type for Gemma 3); older files
    # write rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        params = params.get(layer_type) or {}
    return params or {}


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_scaling(cfg: dict[str, Any], source: str) -> dict[str, Any] | None:
    scaling = dict(rope_params(cfg) or cfg.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)  # a spec field of its own
    scaling = check_rope_type(scaling, source)
    if scaling is not None and scaling["rope_type"] in ("yarn", "longrope"):
        # their tables depend on the context lengths, which configs keep at the top level
        scaling.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
        scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    return scaling


def check_rope_type(scaling: dict[str, Any], source: str) -> dict[str, Any] | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported rope_type={rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    scaling = {k: v for k, v in scaling.items() if k != "type"}
    return {**scaling, "rope_type": rope_type}
