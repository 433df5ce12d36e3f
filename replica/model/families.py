"""Model families: what each one changes on ModelSpec, read from its config.json.

A family is a function from the config to the ModelSpec fields that differ from Llama's
(see spec.py's ModelSpec for what each field means), chosen once by `model_type`. The decoder reads
those fields; nothing here holds a tensor. To add a family: write its function, add it to
FAMILIES, and add an oracle test in tests/replica/model/test_families.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from replica.model.gemma4_config import GEMMA4_TEXT_DEFAULTS, gemma4_fields
from replica.model.hf_config import (
    FULL,
    SLIDING,
    ModelConfigError,
    RopeSpec,
    check_rope_type,
    rope_params,
    rope_scaling,
)
from replica.model.hybrid import LINEAR_ATTENTION, LinearAttentionSpec

Config = dict[str, Any]
FamilyFields = dict[str, Any]

# Gemma 3's text config as transformers fills it in: the multimodal checkpoints' config.json
# writes only the values that differ from these (Gemma3TextConfig's defaults).
GEMMA3_TEXT_DEFAULTS: Config = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
# Qwen3_5TextConfig's defaults for what a config.json may leave out (the shapes the Hub's
# files always write are not defaulted)
QWEN3_5_TEXT_DEFAULTS: Config = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
# Config values a family's config.json may leave out, as transformers fills them in (its
# <Family>Config's defaults; the context length, norm epsilon, rope base and window differ
# by family, and a file without them is read as transformers reads it)
QWEN_CONTEXT: Config = {"max_position_embeddings": 32768}
CONFIG_DEFAULTS: dict[str, Config] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131_072, "sliding_window": 4096},
    "mixtral": {
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
    },
    "qwen2": QWEN_CONTEXT,
    "qwen3": QWEN_CONTEXT,
    "gemma2": {
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
    },
    "gemma3": GEMMA3_TEXT_DEFAULTS,
    "gemma3_text": GEMMA3_TEXT_DEFAULTS,
    "phi3": {"original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "gemma4": GEMMA4_TEXT_DEFAULTS,
    "gemma4_text": GEMMA4_TEXT_DEFAULTS,
    "qwen3_moe": {**QWEN_CONTEXT, "decoder_sparse_step": 1, "norm_topk_prob": False},
    "qwen3_5": QWEN3_5_TEXT_DEFAULTS,
    "qwen3_5_text": QWEN3_5_TEXT_DEFAULTS,
    "qwen3_5_moe": {**QWEN3_5_TEXT_DEFAULTS, "intermediate_size": 0},  # no dense MLP
    "qwen3_5_moe_text": {**QWEN3_5_TEXT_DEFAULTS, "intermediate_size": 0},
    "gpt_oss": {  # GptOssConfig's defaults, which the Hub's config.json leaves out
        "max_position_embeddings": 131_072,
        "attention_bias": True,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "rope_theta": 150_000.0,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },  # fmt: skip
}
# Where a multimodal Gemma 3 checkpoint keeps its language model: transformers 5 saves
# model.language_model.*, the Hub's 4.x-era files hold language_model.model.*.
GEMMA3_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Qwen3.5's Hub checkpoints (Qwen3_5ForConditionalGeneration) keep the language model
# under model.language_model.*, a text-only Qwen3_5ForCausalLM under model.*
QWEN3_5_PREFIXES = ("model.language_model.", "model.")


# Gemma 4's: Gemma4ForConditionalGeneration's language model, or Gemma4ForCausalLM's.
GEMMA4_PREFIXES = ("model.language_model.", "model.")


def family_config(cfg: Config, source: str) -> tuple[Config, FamilyFields]:
    """The config as the family reads it (a multimodal checkpoint's text_config, defaults
    filled in) and the ModelSpec fields the family sets."""
    arch = cfg.get("model_type")
    family = FAMILIES.get(arch)
    if family is None:
        raise ModelConfigError(
            f"{source}: unsupported architecture model_type={arch!r}; "
            f"supported: {', '.join(FAMILIES)}"
        )
    cfg = _text_config(cfg) if "text_config" in cfg else cfg
    cfg = {**CONFIG_DEFAULTS.get(arch, {}), **cfg}
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
    return cfg, family(cfg, source)


def _llama(cfg: Config, source: str) -> FamilyFields:
    _check_act(cfg, source, "silu")
    _no_o_bias(cfg, source)
    return {}


def _mistral(cfg: Config, source: str) -> FamilyFields:
    return {**_llama(cfg, source), **_every_layer_window(cfg)}


def _qwen2(cfg: Config, source: str) -> FamilyFields:
    _check_act(cfg, source, "silu")
    return {"qkv_bias": True, **_qwen_windows(cfg)}


def _qwen3(cfg: Config, source: str) -> FamilyFields:
    _check_act(cfg, source, "silu")
    _no_o_bias(cfg, source)
    return {"qk_norm": True, **_qwen_windows(cfg)}


def _gemma2(cfg: Config, source: str) -> FamilyFields:
    return {
        **_gemma_common(cfg, source),
        **_layer_windows(cfg, [SLIDING if (i + 1) % 2 else FULL for i in _layers(cfg)]),
        "attn_soft_cap": _positive(cfg, "attn_logit_softcapping", source, default=50.0),
        "final_soft_cap": _positive(cfg, "final_logit_softcapping", source, default=30.0),
    }


def _gemma3(cfg: Config, source: str) -> FamilyFields:
    pattern = int(cfg["sliding_window_pattern"])
    local = rope_params(cfg, SLIDING)
    local_theta = float(local.get("rope_theta", cfg["rope_local_base_freq"]))
    local_scaling = {k: v for k, v in local.items() if k != "rope_theta"}
    return {
        **_gemma_common(cfg, source),
        **_layer_windows(cfg, [SLIDING if (i + 1) % pattern else FULL for i in _layers(cfg)]),
        "qk_norm": True,
        "local_rope": RopeSpec(local_theta, check_rope_type(local_scaling, source)),
        "attn_soft_cap": _positive(cfg, "attn_logit_softcapping", source, default=None),
        "final_soft_cap": _positive(cfg, "final_logit_softcapping", source, default=None),
        "weight_prefixes": GEMMA3_PREFIXES,
    }


def _phi3(cfg: Config, source: str) -> FamilyFields:
    _check_act(cfg, source, "silu")
    _no_o_bias(cfg, source)
    params = rope_params(cfg) or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):  # Phi-3's old names
        cfg = {**cfg, "rope_scaling": {**params, "rope_type": "longrope", "type": "longrope"}}
        cfg.pop("rope_parameters", None)
    return {
        "rope_scaling": rope_scaling(cfg, source),
        "fused_qkv": True,
        "fused_gate_up": True,
        "partial_rotary_factor": float(factor),
        **_every_layer_window(cfg),
    }


def _mixtral(cfg: Config, source: str) -> FamilyFields:
    # softmax over every expert, top-k, renormalised; every layer sparse; Mistral's window
    return {
        **_mistral(cfg, source),
        **_experts(cfg, source, "intermediate_size"),
        "moe_block": "block_sparse_moe",
        "expert_names": ("w1", "w3", "w2"),
    }


def _qwen3_moe(cfg: Config, source: str) -> FamilyFields:
    # Qwen3's attention; experts on layers (i+1) % decoder_sparse_step == 0 outside
    # mlp_only_layers, the rest dense (intermediate_size); renormalised if norm_topk_prob
    fields = {
        **_qwen3(cfg, source),
        **_experts(cfg, source, "moe_intermediate_size"),
    }
    if not fields["num_experts"]:
        return _qwen3(cfg, source)
    step = int(cfg.get("decoder_sparse_step", 1))
    only = cfg.get("mlp_only_layers") or []
    if step < 1 or not isinstance(only, list):
        raise ModelConfigError(
            f"{source}: decoder_sparse_step={step!r} must be >= 1 and mlp_only_layers "
            f"={only!r} a list of layers"
        )
    dense = tuple(i for i in _layers(cfg) if i in only or (i + 1) % step)
    return {**fields, "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": dense}  # fmt: skip


def _gpt_oss(cfg: Config, source: str) -> FamilyFields:
    # every layer sparse: top-k of the router's logits (it has a bias), softmaxed over the
    # k (= the renormalised top k of the full softmax); experts with biases and the clamped
    # SwiGLU, stacked in the checkpoint; attention with biases on q/k/v/o and a sink per
    # head; sliding and full layers alternate; yarn rope
    bias = bool(cfg.get("attention_bias"))
    fields = {
        **_experts(cfg, source, "intermediate_size"),
        **_layer_windows(cfg, [SLIDING if (i + 1) % 2 else FULL for i in _layers(cfg)]),
        "qkv_bias": bias,
        "o_bias": bias,
        "attn_sinks": True,
        "router_name": "router",
        "moe_bias": True,
        "swiglu_limit": _positive(cfg, "swiglu_limit", source, default=7.0),
        "swiglu_alpha": _positive(cfg, "swiglu_alpha", source, default=1.702),
        "expert_layout": "gpt_oss",
    }
    if not fields["num_experts"]:
        raise ModelConfigError(f"{source}: gpt_oss needs num_local_experts >= 1")
    return fields


def _qwen3_5(cfg: Config, source: str) -> FamilyFields:
    # Gated DeltaNet layers (linear_attention in layer_types, else 3 of every 4) beside
    # gated full-attention ones: q_proj also gives a per-head output gate, q/k norms, partial
    # rotary (the mrope sections a text-only prompt reduces to plain rope over the first
    # rotary dims); every norm x̂·(1+w) in fp32 but the linear attention's gated one
    _check_act(cfg, source, "silu")
    _no_o_bias(cfg, source)
    params = rope_params(cfg)
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    layers = _layers(cfg)
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or [
        FULL if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in layers
    ]
    unknown = sorted(set(types) - {FULL, LINEAR_ATTENTION})
    if len(types) != len(layers) or unknown:
        raise ModelConfigError(
            f"{source}: layer_types must name {len(layers)} layers, each "
            f"{FULL!r} or {LINEAR_ATTENTION!r} (got {unknown or len(types)})"
        )
    linear = tuple(i for i in layers if types[i] == LINEAR_ATTENTION)
    try:
        spec = LinearAttentionSpec(
            layers=linear,
            num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        )
    except KeyError as e:
        raise ModelConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    if spec.num_value_heads % spec.num_key_heads or spec.conv_kernel < 2:
        raise ModelConfigError(
            f"{source}: linear_num_value_heads={spec.num_value_heads} must be a multiple of "
            f"linear_num_key_heads={spec.num_key_heads} and linear_conv_kernel_dim="
            f"{spec.conv_kernel} >= 2"
        )
    return {
        "gemma_norm": True,
        "qk_norm": True,
        "attn_output_gate": True,
        "partial_rotary_factor": float(factor),
        "linear_attention": spec,
        "kv_sources": tuple(None if i in linear else i for i in layers),
        "weight_prefixes": QWEN3_5_PREFIXES,
    }


def _qwen3_5_moe(cfg: Config, source: str) -> FamilyFields:
    # Qwen3.5's layers, every MLP sparse: softmax over the experts, top-k renormalised,
    # plus a shared expert (shared_expert_intermediate_size) scaled by
    # sigmoid(shared_expert_gate(x)); experts as the Hub ships them, per expert
    experts = {**cfg, "shared_expert_intermediate_size": 0}
    fields = {**_qwen3_5(cfg, source), **_experts(experts, source, "moe_intermediate_size")}
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not fields["num_experts"] or shared <= 0:
        raise ModelConfigError(
            f"{source}: qwen3_5_moe needs num_experts >= 1 and "
            f"shared_expert_intermediate_size >= 1 (got {fields['num_experts']}, {shared})"
        )
    return {**fields, "norm_topk_prob": True, "shared_expert_size": shared}


def _experts(cfg: Config, source: str, size_key: str) -> FamilyFields:
    # the Hub's Qwen3-MoE configs say num_experts, transformers 5 saves num_local_experts
    experts = cfg.get("num_local_experts", cfg.get("num_experts")) or 0
    try:
        experts, k = int(experts), int(cfg["num_experts_per_tok"])
        size = int(cfg[size_key])
    except KeyError as e:
        raise ModelConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    if cfg.get("n_shared_experts") or cfg.get("shared_expert_intermediate_size"):
        raise ModelConfigError(f"{source}: shared experts are not supported")
    return {"num_experts": experts, "num_experts_per_tok": k, "moe_intermediate_size": size}


def _gemma4(cfg: Config, source: str) -> FamilyFields:
    # Gemma 3's sandwich norms and q/k norms, with Gemma 4's differences: norms x̂·w in
    # fp32, values normed too, scores unscaled; full layers with their own head_dim and KV
    # heads (per_layer_config, or global_head_dim / num_global_key_value_heads), values from
    # k_proj under attention_k_eq_v, and proportional partial rotary; the last
    # num_kv_shared_layers layers read the KV of the last earlier layer of their type (and
    # have a double-wide MLP under use_double_wide_mlp); per-layer input embeddings; a
    # stored scalar per layer; a final soft-cap
    if cfg.get("use_bidirectional_attention") == "all":
        raise ModelConfigError(
            f"{source}: use_bidirectional_attention='all' (an encoder) is not served: this "
            "server generates text with causal attention"
        )
    common = _gemma_common({**cfg, "use_bidirectional_attention": None}, source)
    return {
        **common,
        "gemma_norm": False,
        "attn_scale": 1.0,
        "final_soft_cap": _positive(cfg, "final_logit_softcapping", source, default=None),
        "weight_prefixes": GEMMA4_PREFIXES,
        **gemma4_fields(cfg, source),
    }


FAMILIES: dict[str, Callable[[Config, str], FamilyFields]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe,
}


def _text_config(cfg: Config) -> Config:
    """A multimodal checkpoint's language model (Gemma 3 >= 4B): its text_config, with
    the token ids and tying that only the top level states. Images are not served."""
    text = dict(cfg["text_config"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    text["model_type"] = cfg["model_type"]
    return text


def _layers(cfg: Config) -> range:
    return range(int(cfg.get("num_hidden_layers", 0)))


def _layer_windows(cfg: Config, default_types: list[str]) -> FamilyFields:
    """Sliding layers and their window: the config's layer_types, else the family's rule."""
    types = tuple(cfg.get("layer_types") or default_types)
    window = cfg.get("sliding_window")
    if not window or SLIDING not in types:
        return {}
    return {"layer_types": types, "sliding_window": int(window)}


def _every_layer_window(cfg: Config) -> FamilyFields:
    return _layer_windows(cfg, [SLIDING] * len(_layers(cfg)))


def _qwen_windows(cfg: Config) -> FamilyFields:
    # Qwen's window exists only with use_sliding_window, on layers >= max_window_layers
    if not cfg.get("use_sliding_window", False):
        return {}
    first = int(cfg.get("max_window_layers", 28))
    return _layer_windows(cfg, [SLIDING if i >= first else FULL for i in _layers(cfg)])


def _gemma_common(cfg: Config, source: str) -> FamilyFields:
    _check_act(cfg, source, "gelu_pytorch_tanh")
    _no_o_bias(cfg, source)
    if cfg.get("use_bidirectional_attention"):  # EmbeddingGemma: an encoder, not causal
        raise ModelConfigError(
            f"{source}: use_bidirectional_attention=true (an embedding model) is not "
            "served: this server generates text with causal attention"
        )
    scalar = _positive(cfg, "query_pre_attn_scalar", source, default=None)
    return {
        "gemma_norm": True,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "embed_scale": math.sqrt(int(cfg["hidden_size"])),
        "attn_scale": None if scalar is None else scalar**-0.5,
    }


def _check_act(cfg: Config, source: str, expected: str) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or expected
    if act != expected:
        raise ModelConfigError(
            f"{source}: unsupported activation {act!r} for model_type={cfg.get('model_type')!r}"
            f" (expected {expected!r})"
        )


def _no_o_bias(cfg: Config, source: str) -> None:
    if cfg.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias=true (o_proj bias) is not supported")


def _positive(cfg: Config, key: str, source: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelConfigError(f"{source}: {key}={value!r} must be a positive number")
    return float(value)
