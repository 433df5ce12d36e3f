"""Random-weight models of every supported family, built by transformers from a config.

For the family oracle tests and `lorafleet bench engine --family`: a real Hugging Face
directory (config.json, model.safetensors) whose quirks all bite: norm weights moved away
from their init, heads × head_dim ≠ hidden, a short sliding window, q/k norms, soft-caps
that change scores, partial rotary. Weights are drawn so that logits are peaky (greedy
decoding is stable across kernels), at the demo model's scales.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

# Per family: the transformers config class and the fields that make its quirks bite at a
# tiny size. "demo" sizes scale hidden/intermediate/layers up to the demo model's.
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256}  # fmt: skip
DEMO = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2048,
        "max_position_embeddings": 2048}  # fmt: skip
GEMMA4_QUIRKS: dict[str, Any] = {
    "num_hidden_layers": 6, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 256, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "final_logit_softcapping": 15.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 10000.0},
    },
}  # fmt: skip
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 24: heads × head_dim (96) ≠ hidden (64); a window on layer 1 only
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False,
                              "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1}),
    # query_pre_attn_scalar ≠ head_dim; caps low enough that scores and logits hit them
    "gemma2": ("Gemma2Config", {"head_dim": 32, "query_pre_attn_scalar": 20,
                                "sliding_window": 8, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 15.0}),
    # local layers: window 8, rope base 100; global: base 1e4 with linear scaling
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "query_pre_attn_scalar": 20,
                                    "sliding_window": 8, "sliding_window_pattern": 2,
                                    "rope_local_base_freq": 100.0, "rope_theta": 10000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # the multimodal layout of Gemma 3 >= 4B: text_config nested, a (tiny) vision tower
    "gemma3-mm": ("Gemma3Config", {"head_dim": 32, "query_pre_attn_scalar": 20,
                                   "sliding_window": 8, "sliding_window_pattern": 2}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "sliding_window": 12,
                            "tie_word_embeddings": False}),
    # top-2 of 4 experts on every layer, renormalised; Mistral's window
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 12, "tie_word_embeddings": False}),
    # top-2 of 8 experts of 32 columns, not renormalised; layer 1 of 3 dense
    # (mlp_only_layers); Qwen3's q/k norms and head_dim ≠ hidden / heads
    "qwen3moe": ("Qwen3MoeConfig", {"head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "norm_topk_prob": False,
                                    "num_hidden_layers": 3, "mlp_only_layers": [1],
                                    "tie_word_embeddings": False}),
    # top-2 of 4 experts with biases and the clamped SwiGLU (a limit that clamps, alpha ≠
    # 1.702), attention biases and sinks, sliding (window 8) and full layers alternating,
    # yarn over a 64-token original context; head_dim 24: heads × head_dim ≠ hidden
    "gptoss": ("GptOssConfig", {"head_dim": 24, "intermediate_size": 64,
                                "num_local_experts": 4, "num_experts_per_tok": 2,
                                "sliding_window": 8, "swiglu_limit": 1.5, "swiglu_alpha": 1.5,
                                "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                    "beta_fast": 32.0, "beta_slow": 1.0,
                                                    "truncate": False, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 64},
                                "tie_word_embeddings": False}),
    # Gemma 4 with every quirk on: 6 layers, sliding (window 8, head_dim 16, 2 KV heads,
    # rope base 100) and full (head_dim 32, 1 KV head, values = keys' projection,
    # proportional rope over a quarter of the pairs) alternating; the last 2 layers read
    # layers 2's and 3's KV and have a double-wide MLP; per-layer inputs of width 8; a
    # final soft-cap that bites
    "gemma4": ("Gemma4TextConfig", GEMMA4_QUIRKS),
    # the same text model in Gemma4ForConditionalGeneration's layout, a tiny vision tower
    "gemma4-mm": ("Gemma4Config", GEMMA4_QUIRKS),
    # the MoE block: top-2 of 4 experts of 32 columns beside every layer's dense MLP
    "gemma4moe": ("Gemma4TextConfig", {**GEMMA4_QUIRKS, "enable_moe_block": True,
                                       "num_experts": 4, "top_k_experts": 2,
                                       "moe_intermediate_size": 32}),
    # Qwen3.5 in the Hub's multimodal layout (a tiny vision tower beside the language
    # model): Gated DeltaNet layers 0 and 2, gated full attention on 1 and 3; linear
    # attention with 2 key heads of 16 and 6 value heads of 12 (≠ the 4 attention heads
    # of 32: heads × head_dim ≠ hidden), a 4-tap conv; partial rotary of 8 dims
    "qwen35": ("Qwen3_5Config", {"head_dim": 32, "num_hidden_layers": 4,
                                 "layer_types": ["linear_attention", "full_attention"] * 2,
                                 "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                                 "linear_key_head_dim": 16, "linear_value_head_dim": 12,
                                 "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
                                 "rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.25,
                                                     "mrope_section": [1, 1, 2],
                                                     "mrope_interleaved": True}}),
    # Qwen3.5-MoE: qwen35's layers, every MLP top-2 of 4 experts of 32 columns
    # (renormalised) plus a shared expert of 48 behind its sigmoid gate
    "qwen35moe": ("Qwen3_5MoeConfig", {"head_dim": 32, "num_hidden_layers": 4,
                                       "layer_types": ["linear_attention",
                                                       "full_attention"] * 2,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 12,
                                       "linear_conv_kernel_dim": 4, "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48,
                                       "tie_word_embeddings": False,
                                       "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25,
                                                           "mrope_section": [1, 1, 2],
                                                           "mrope_interleaved": True}}),
}  # fmt: skip
# At demo size (the bench's models) the shapes and settings of the real checkpoints instead
# of the quirks that make the tiny oracle models' tests bite: Qwen3-0.6B's head_dim 128
# (heads x head_dim = 2 x hidden) and no window; Gemma 2's window 4096, its caps (50, 30)
# and query_pre_attn_scalar = head_dim, with head_dim 64 = hidden / heads.
DEMO_QUIRKS: dict[str, dict[str, Any]] = {
    "gemma4": {"vocab_size_per_layer_input": DEMO["vocab_size"]},  # one per token id
    "qwen3": {"head_dim": 128, "use_sliding_window": False},
    # a small Qwen3-MoE: 8 experts of 256 columns, top-2, every layer sparse (Qwen3-30B-A3B
    # has 128 of 768, top-8, renormalised)
    "qwen3moe": {"head_dim": 64, "moe_intermediate_size": 256, "num_hidden_layers": 8,
                 "mlp_only_layers": [], "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 384},
    # a small Qwen3.5 with the real head and state shapes (Qwen3.5-0.8B's): attention heads
    # of 256 with 2 KV heads, linear attention of 128-dim heads (4 key, 8 value), a 4-tap
    # conv; 3 of every 4 layers linear
    "qwen35": {"head_dim": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 8,
               "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                              + ["linear_attention"] * 3 + ["full_attention"],
               "linear_num_key_heads": 4, "linear_num_value_heads": 8,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128},
    "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # a small gpt-oss: 8 experts of 256 columns, top-2; gpt-oss-20b's head_dim 64, window
    # 128, SwiGLU constants and yarn (gpt-oss-20b: 32 experts of 2880, top-4)
    "gptoss": {"head_dim": 64, "intermediate_size": 256, "num_local_experts": 8,
               "sliding_window": 128, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
               "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False,
                                   "rope_theta": 150000.0,
                                   "original_max_position_embeddings": 4096}},
}  # fmt: skip


# Qwen3.5's config classes and their multimodal model (the Hub's layout)
QWEN3_5 = {"Qwen3_5Config": "Qwen3_5ForConditionalGeneration",
           "Qwen3_5MoeConfig": "Qwen3_5MoeForConditionalGeneration"}  # fmt: skip


def family_model_dir(
    family: str, size: str = "tiny", overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Build once (cached under $LORAFLEET_CACHE or ~/.cache/lorafleet) and return the
    model directory of `family` at `size` ("tiny" or "demo")."""
    cls_name, quirks = FAMILY_CONFIGS[family]
    if size == "demo":
        quirks = {**quirks, **DEMO_QUIRKS.get(family, {})}
    fields = {**(TINY if size == "tiny" else DEMO), **quirks, **(overrides or {})}
    key = json.dumps([cls_name, fields, seed, 3], sort_keys=True)  # 3: the draw's version
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache/lorafleet"
    out = Path(root) / f"family-{family}-{size}-{digest}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build_family_model(tmp, cls_name, fields, seed)
        try:
            os.rename(tmp, out)  # atomic: readers never see half a directory
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_family_model(out: Path, cls_name: str, fields: dict[str, Any], seed: int) -> None:
    import transformers

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if cls_name in QWEN3_5:  # multimodal as on the Hub: text model nested, tiny vision
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                  "out_hidden_size": fields["hidden_size"], "patch_size": 14}  # fmt: skip
        top = {"tie_word_embeddings": fields["tie_word_embeddings"], **ids}
        config = getattr(transformers, cls_name)(
            text_config={**fields, **ids}, vision_config=vision, **top
        )
        model = getattr(transformers, QWEN3_5[cls_name])(config)
    elif cls_name == "Gemma3Config":  # multimodal: the text model nested, a tiny vision tower
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
        config = transformers.Gemma3Config(
            text_config={**fields, **ids}, vision_config=vision, mm_tokens_per_image=4, **ids
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
    elif cls_name == "Gemma4Config":  # the text model nested, a tiny vision tower
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                  "patch_size": 4, "position_embedding_size": 64}  # fmt: skip
        config = transformers.Gemma4Config(text_config={**fields, **ids}, vision_config=vision,
                                           **ids)  # fmt: skip
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        config = getattr(transformers, cls_name)(**fields, **ids)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    gemma = cls_name.startswith("Gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_draw(name, tuple(p.shape), gen, gemma, fields["num_hidden_layers"]))
            if cls_name == "GptOssConfig":
                p.copy_(_gpt_oss_draw(name, p, gen))
            if cls_name.startswith("Gemma4") and "norm" in name:  # x̂·w: Gemma's 1+w,
                p.add_(1.0)  # branches of a third of Gemma 3's (its 6 layers' sums stay in
                if "post_" in name:  # fp32's reach of transformers' logits to 2e-4),
                    p.div_(3.0)  # q·k of std ~2 (its scores are unscaled: q, k normed)
                if "q_norm" in name or "k_norm" in name:
                    p.mul_(0.5)
            if name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            if name.endswith("router.proj.weight"):  # Gemma 4's router reads a unit-norm
                p.mul_(4.0 * math.sqrt(p.shape[-1]))  # input: logits of std ~4, as mlp.gate's
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's output scalars, away from 1
                b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=gen))
            if cls_name in QWEN3_5:
                p.copy_(_qwen3_5_draw(name, p, gen, fields["num_hidden_layers"]))
    model.save_pretrained(out)


def _gpt_oss_draw(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """gpt-oss's own parameters at scales that bite: sink logits near a 40-token row's
    log-sum-exp (so a sink takes a real share of it), routers like _draw's, stacked
    experts stored [E, in, out] drawn by their fan-in (dim 1)."""
    if name.endswith("sinks"):
        return 3.0 + torch.randn(p.shape, generator=gen)
    if name.endswith("router.weight"):
        return torch.randn(p.shape, generator=gen) * 4.0 / math.sqrt(p.shape[-1])
    if name.endswith("experts.gate_up_proj"):
        return torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
    return p


def _qwen3_5_draw(name: str, p: torch.Tensor, gen: torch.Generator, layers: int) -> torch.Tensor:
    """Qwen3.5's own parameters: its norms store w of x̂·(1+w) (near 0) but the linear
    attention's gated norm w of w·x̂ (near 1); decays exp(A_log) of 0.5..2 and dt_bias
    spread so that every head forgets at its own rate; out_proj writes like o_proj."""
    noise = torch.randn(p.shape, generator=gen)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.2 * noise
    if "norm" in name:
        return 0.2 * noise
    if name.endswith("A_log"):
        return 0.5 * noise
    if name.endswith("dt_bias"):
        return noise
    if name.endswith("out_proj.weight"):
        return noise * 6.0 / math.sqrt(2 * layers * p.shape[-1])
    return p


def _draw(
    name: str, shape: tuple[int, ...], gen: torch.Generator, gemma: bool, layers: int
) -> torch.Tensor:
    """The demo model's scales (cluster/demo/assets.py explains them): logits of std ~6,
    residual branches that write ~6/sqrt(2·layers) each, so every layer matters."""
    noise = torch.randn(shape, generator=gen)
    logit_std = 6.0
    if gemma and ("post_attention" in name or "post_feedforward" in name):
        # Gemma norms each branch's output to unit rms, and its embedding writes ~6 (std
        # 6/sqrt(h) times sqrt(h)): branches of 2·6 keep the tied head from echoing the input
        return 2 * logit_std - 1 + 0.2 * noise
    if name.endswith("mlp.gate.weight"):  # an MoE router: logits of std ~4, so that the
        # top-k choices are clear (rounding never flips one between implementations)
        return noise * 4.0 / math.sqrt(shape[-1])
    if "norm" in name:  # Gemma stores w of x̂·(1+w): both land near identity
        return (0.0 if gemma else 1.0) + 0.2 * noise
    if name.endswith("bias"):
        return 0.1 * noise
    if "embed_tokens" in name or "lm_head" in name:
        return noise * logit_std / math.sqrt(shape[-1])
    if "o_proj" in name or "down_proj" in name:
        return noise * logit_std / math.sqrt(2 * layers * shape[-1])
    return noise / math.sqrt(shape[-1])
