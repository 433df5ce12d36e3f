"""Gemma 4's ModelSpec fields, read from its text config as transformers' Gemma4TextConfig
fills it in (model/families.py calls this for model_type gemma4 and gemma4_text).

What differs per layer is read into per-layer tuples: full layers' head_dim and KV heads
(the saved per_layer_config, or global_head_dim and, under attention_k_eq_v,
num_global_key_value_heads), the KV a layer reads (its own, or for the last
num_kv_shared_layers layers the last earlier layer of the same type's), and the
double-wide MLP of those sharing layers. Nothing here holds a tensor.
"""

from __future__ import annotations

from typing import Any

from replica.model.hf_config import FULL, SLIDING, ModelConfigError, RopeSpec, check_rope_type

Config = dict[str, Any]

# Gemma4TextConfig's defaults that a config.json may leave out.
GEMMA4_TEXT_DEFAULTS: Config = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
               "rope_theta": 1_000_000.0},
    },
}  # fmt: skip
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what per_layer_config may set


def gemma4_fields(cfg: Config, source: str) -> dict[str, Any]:
    """The Gemma 4 fields of ModelSpec (layer types and window, per-layer shapes, KV
    sources, ropes, per-layer inputs, the MoE block)."""
    layers = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or
                 [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])  # fmt: skip
    if len(types) != layers:
        raise ModelConfigError(f"{source}: layer_types has {len(types)} entries for {layers}")
    types[-1] = FULL  # as Gemma4TextConfig forces it
    head_dims, kv_heads = _layer_heads(cfg, types, source)
    sources = _kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0), source)
    width = int(cfg["intermediate_size"])
    wide = bool(cfg.get("use_double_wide_mlp"))
    sizes = tuple(2 * width if wide and sources[i] != i else width for i in range(layers))
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    ple_vocab = int(cfg.get("vocab_size_per_layer_input") or 0)
    if ple and ple_vocab < int(cfg["vocab_size"]):  # transformers indexes it by token id
        raise ModelConfigError(
            f"{source}: vocab_size_per_layer_input={ple_vocab} is smaller than vocab_size="
            f"{cfg['vocab_size']}: a token past it has no per-layer input"
        )
    local, full = _ropes(cfg, source)
    return {
        "layer_types": tuple(types),
        "sliding_window": int(cfg["sliding_window"]),
        "layer_head_dims": head_dims,
        "layer_kv_heads": kv_heads,
        "layer_intermediate_sizes": sizes if wide else (),
        "kv_sources": sources if any(s != i for i, s in enumerate(sources)) else (),
        "qk_norm": True,
        "v_norm": True,
        "norm_fp32_weight": True,
        "k_eq_v": bool(cfg.get("attention_k_eq_v")),
        "per_layer_input_size": ple,
        "per_layer_vocab_size": ple_vocab if ple else 0,
        "layer_scalar": True,
        "local_rope": local,
        "rope_scaling": full.scaling,
        **_moe_block(cfg, source),
    }


def _moe_block(cfg: Config, source: str) -> dict[str, Any]:
    """enable_moe_block: every layer runs top_k_experts of num_experts beside its dense MLP,
    routed from the residual stream (layers.L.router.proj; stacked layers.L.experts)."""
    if not cfg.get("enable_moe_block"):
        return {}
    try:
        experts, k = int(cfg["num_experts"]), int(cfg["top_k_experts"])
        width = int(cfg["moe_intermediate_size"])
    except (KeyError, TypeError):
        raise ModelConfigError(
            f"{source}: enable_moe_block=true needs num_experts, top_k_experts and "
            "moe_intermediate_size"
        ) from None
    return {
        "num_experts": experts,
        "num_experts_per_tok": k,
        "moe_intermediate_size": width,
        "norm_topk_prob": True,
        "moe_block": "router",
        "router_name": "proj",
        "expert_layout": "gemma4",
        "moe_beside_mlp": True,
    }


def _layer_heads(
    cfg: Config, types: list[str], source: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head_dim and KV heads: per_layer_config's overrides as transformers
    saves them, else global_head_dim (and num_global_key_value_heads under
    attention_k_eq_v) on full layers."""
    head_dim, kv = int(cfg["head_dim"]), int(cfg["num_key_value_heads"])
    overrides = cfg.get("per_layer_config")
    if not isinstance(overrides, dict):
        over: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim") or GLOBAL_HEAD_DIM)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            over["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        overrides = {i: over for i, t in enumerate(types) if t == FULL}
    by_layer = {int(k): v for k, v in overrides.items()}
    dims, heads = [], []
    for i in range(len(types)):
        over = by_layer.get(i) or {}
        unknown = set(over) - set(LAYER_OVERRIDES)
        if unknown:
            raise ModelConfigError(
                f"{source}: per_layer_config[{i}] sets {sorted(unknown)}, which this server "
                f"does not vary per layer (only {', '.join(LAYER_OVERRIDES)})"
            )
        dims.append(int(over.get("head_dim", head_dim)))
        heads.append(int(over.get("num_key_value_heads", kv)))
    return tuple(dims), tuple(heads)


def _kv_sources(types: list[str], shared: int, source: str) -> tuple[int, ...]:
    """Per layer, the layer whose KV it reads: itself, or for the last `shared` layers
    the last earlier non-sharing layer of the same type (Gemma4TextConfig.kv_sharing_modes)."""
    layers = len(types)
    first = layers - shared
    if not 0 <= shared < layers:
        raise ModelConfigError(
            f"{source}: num_kv_shared_layers={shared} must be in 0..{layers - 1}"
        )
    sources = list(range(layers))
    for i in range(first, layers):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ModelConfigError(
                f"{source}: layer {i} ({types[i]}) shares KV, but no earlier layer of its type "
                "keeps one"
            )
        sources[i] = owners[-1]
    return tuple(sources)


def _ropes(cfg: Config, source: str) -> tuple[RopeSpec, RopeSpec]:
    """The sliding and the full layers' rope: theta and scaling (proportional keeps its
    partial_rotary_factor: it rotates a share of every head's frequency pairs)."""
    params = cfg.get("rope_parameters") or GEMMA4_TEXT_DEFAULTS["rope_parameters"]
    ropes = []
    for kind in (SLIDING, FULL):
        p = dict(params.get(kind) or GEMMA4_TEXT_DEFAULTS["rope_parameters"][kind])
        theta = float(p.pop("rope_theta", 10_000.0))
        if p.get("rope_type", p.get("type")) != "proportional":
            p.pop("partial_rotary_factor", None)  # read by proportional rope only
        ropes.append(RopeSpec(theta, check_rope_type(p, source)))
    return ropes[0], ropes[1]
