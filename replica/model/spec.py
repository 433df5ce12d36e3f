"""The model's shape and its family's differences, read once from a Hugging Face config.json.

One decoder (model/decoder.py) serves every family; what differs between Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen3-MoE, gpt-oss and Qwen3.5 (dense and
MoE) is data on ModelSpec, filled in by model/families.py from the config: norm style and
count, q/k norms, attention scale, soft-caps and sinks, an attention output gate, which
layers slide and their rope, which layers are linear attention (Gated DeltaNet) and their
shapes, fused checkpoint projections and biases, the MLP's activation, the embedding
scale, and for mixtures of experts the experts, the router's rule, biases, a shared expert,
checkpoint layout and which layers are sparse. One fact config.json cannot give, whether
a Gemma 4 checkpoint holds its experts stacked or un-fused per expert, load_model_spec
reads from the checkpoint's tensor names when the directory has them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from replica.model.families import family_config
from replica.model.hf_config import (
    SLIDING,
    ModelConfigError,
    RopeSpec,
    rope_scaling,
    rope_theta,
)
from replica.model.hybrid import LINEAR_MODULES, LinearAttentionSpec
from replica.model.quant_config import QuantScheme, quant_scheme
from replica.model.weights import tensor_files

__all__ = ["ModelConfigError", "ModelSpec", "RopeSpec", "load_model_spec", "spec_from_dict"]

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNFUSED_EXPERT = re.compile(r"\.layers\.\d+\.experts\.\d+\.")  # Gemma 4's, un-fused
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


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
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2), o does not
    sliding_window: int | None  # the window of the layers layer_types marks sliding
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # --- family differences; the defaults are Llama's ---
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer; () = every layer FULL
    local_rope: RopeSpec | None = None  # the sliding layers' rope when it differs (Gemma 3)
    partial_rotary_factor: float = 1.0  # rotate only the first head_dim * this dims (Phi-3)
    gemma_norm: bool = False  # RMSNorm as x̂·(1+w) in fp32 (Gemma), not w·x̂ (Llama)
    sandwich_norms: bool = False  # norms after attention and MLP too: four per layer (Gemma)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # scores -> cap·tanh(scores/cap) (Gemma 2)
    final_soft_cap: float | None = None  # logits -> cap·tanh(logits/cap) (Gemma 2)
    hidden_act: str = "silu"  # MLP activation: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    fused_qkv: bool = False  # the checkpoint holds one qkv_proj / gate_up_proj (Phi-3)
    fused_gate_up: bool = False
    weight_prefixes: tuple[str, ...] = ("model.",)  # where the decoder's tensors may live
    # --- mixtures of experts (Mixtral, Qwen3-MoE); num_experts 0: a dense model ---
    num_experts: int = 0  # routed experts of each sparse layer
    num_experts_per_tok: int = 0  # k: experts each token runs through
    moe_intermediate_size: int = 0  # one expert's intermediate size
    # the top-k router weights renormalised to sum 1 (Mixtral always; Qwen3-MoE's
    # norm_topk_prob); else the softmax over every expert's logits, as picked
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense
    moe_block: str = "mlp"  # the checkpoint's module of router and experts (Mixtral's
    # block_sparse_moe) and one expert's gate, up and down (Mixtral's w1, w3, w2)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # --- gpt-oss ---
    o_bias: bool = False  # o_proj carries a bias too (gpt-oss's attention_bias)
    attn_sinks: bool = False  # each head's learned sink logit joins its softmax
    router_name: str = "gate"  # the router's module in moe_block (gpt-oss: "router")
    moe_bias: bool = False  # the router and every expert projection carry biases
    # the experts' clamped SwiGLU (gpt-oss): gate clamped to <= limit, up to [-limit,
    # limit], hidden = (up + 1) · gate · sigmoid(alpha · gate); None: act(gate) · up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # "per_expert": the Hub's <moe_block>.experts.{e}.<proj>.weight; "gpt_oss": stacked
    # mlp.experts.gate_up_proj [E, hidden, 2I] (gate and up columns interleaved) and
    # down_proj [E, I, hidden] with their biases, or their MXFP4 *_blocks / *_scales
    expert_layout: str = "per_expert"
    # Gemma 4's experts as its checkpoint holds them, read from the tensor names by
    # load_model_spec (config.json cannot tell): True un-fused per expert
    # (layers.L.experts.{e}.<gate|up|down>_proj, a quantizer's layout, packed), False
    # stacked (experts.gate_up_proj / down_proj, as transformers saves them, dense);
    # None: no checkpoint at hand, read and planned stacked (for a quantized model the
    # larger: the plan errs high)
    experts_unfused: bool | None = None
    # --- a quantized checkpoint (model/quant_config.py): how each projection is stored ---
    quant: QuantScheme | None = None
    # --- which layers own a KV pool: per layer, the layer whose K/V it attends over
    # (itself; an earlier layer's when the family shares KV, as Gemma 4's last layers do)
    # or None when it keeps no KV (a linear-attention layer); () = every layer its own ---
    kv_sources: tuple[int | None, ...] = ()
    # --- per-layer shapes where layers differ (Gemma 4: full layers' wider heads and
    # fewer KV heads, KV-sharing layers' double-wide MLP); () = every layer the above ---
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()
    # --- Gemma 4 ---
    norm_fp32_weight: bool = False  # RMSNorm as x̂·w in fp32, rounded last (Gemma 4)
    v_norm: bool = False  # values RMS-normed over head_dim, without a weight
    k_eq_v: bool = False  # full layers have no v_proj: values are k_proj's output
    per_layer_input_size: int = 0  # per-layer input embeddings' width (0: none)
    per_layer_vocab_size: int = 0  # rows of the per-layer input embedding
    layer_scalar: bool = False  # each layer's output times its stored scalar
    # the experts run beside the dense MLP, not in its place (Gemma 4's MoE block)
    moe_beside_mlp: bool = False
    # --- hybrid linear attention (Qwen3.5/3.6): the Gated DeltaNet layers and their
    # shapes (model/hybrid.py); None: every layer attends ---
    linear_attention: LinearAttentionSpec | None = None
    # q_proj gives each head a gate too ([q_h, gate_h] per head): attention's output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3.5's full-attention layers)
    attn_output_gate: bool = False
    # a shared expert of this intermediate size beside the routed ones on every sparse
    # layer, its output times sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE); 0: none
    shared_expert_size: int = 0

    # Derived sizes, read by every layer every step: computed once (the spec is frozen).
    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @cached_property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer(self, layer: int) -> ModelSpec:
        """The spec with `layer`'s own head_dim, KV heads and MLP width (itself when every
        layer has the same shapes)."""
        if not (self.layer_head_dims or self.layer_kv_heads or self.layer_intermediate_sizes):
            return self
        return replace(
            self,
            head_dim=_at(self.layer_head_dims, layer, self.head_dim),
            num_kv_heads=_at(self.layer_kv_heads, layer, self.num_kv_heads),
            intermediate_size=_at(self.layer_intermediate_sizes, layer, self.intermediate_size),
            layer_head_dims=(),
            layer_kv_heads=(),
            layer_intermediate_sizes=(),
        )

    def has_kv_projection(self, layer: int, module: str) -> bool:
        """Whether `layer` has its own k_proj / v_proj (Gemma 4's KV-sharing layers have
        neither; its full layers with k_eq_v no v_proj)."""
        if self.kv_source(layer) != layer:
            return False
        return not (module == "v_proj" and self.k_eq_v and not self.is_sliding(layer))

    def qkv_modules(self, layer: int) -> tuple[str, ...]:
        """The projections `layer` holds in its q/k/v group, in row order: q_proj, then
        the k_proj and v_proj it has of its own (has_kv_projection). A Gemma 4 layer
        without them computes no rows in their place: its KV comes from elsewhere."""
        own = tuple(m for m in ("k_proj", "v_proj") if self.has_kv_projection(layer, m))
        return ("q_proj", *own)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: it attends to the whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope(self, layer: int) -> RopeSpec:
        if self.local_rope is not None and self.is_sliding(layer):
            return self.local_rope
        return RopeSpec(self.rope_theta, self.rope_scaling)

    def kv_source(self, layer: int) -> int | None:
        """The layer whose KV pool `layer` writes and reads (None: it keeps no KV)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that own a KV pool: the cache allocates one per such layer."""
        return tuple(i for i in range(self.num_layers) if self.kv_source(i) == i)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` mixes tokens by linear attention (a Gated DeltaNet layer)."""
        return self.linear_attention is not None and layer in self.linear_attention.layers

    @property
    def attention_layers(self) -> int:
        """How many layers attend (the rest are linear attention)."""
        linear = self.linear_attention
        return self.num_layers - (0 if linear is None else len(linear.layers))

    @cached_property
    def q_proj_size(self) -> int:
        """q_proj's output rows: the queries, and with attn_output_gate each head's gate."""
        return self.q_size * (2 if self.attn_output_gate else 1)

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def num_parameters(self) -> int:
        """Weights the model holds (projections, embeddings, head, norms, routers and
        experts, Gemma 4's per-layer inputs and layer scalars, Qwen3.5's linear-attention
        layers and shared expert; biases aside), each layer of its own shapes."""
        experts = self.num_experts * (
            sum(i * o for i, o in self.expert_shapes().values()) + self.hidden_size
        )  # + the router's row per expert
        if self.shared_expert_size:  # Qwen3.5-MoE's shared expert and its gate's row
            experts += (3 * self.shared_expert_size + 1) * self.hidden_size
        heads = 1 if self.tie_word_embeddings else 2
        total = heads * self.vocab_size * self.hidden_size + self.hidden_size
        for layer in range(self.num_layers):
            own = self.layer(layer)
            shapes = own.module_shapes()
            if self.is_linear(layer):  # it mixes by linear attention instead
                total += self.linear_attention.parameters_per_layer(self.hidden_size)
            else:
                total += sum(shapes[m][0] * shapes[m][1]
                             for m in (*self.qkv_modules(layer), "o_proj"))  # fmt: skip
                if self.qk_norm:  # a layer reading another's KV has no k_norm (Gemma 4)
                    total += (1 + (self.kv_source(layer) == layer)) * own.head_dim
            if self.is_sparse(layer):
                total += experts
            if not self.is_sparse(layer) or self.moe_beside_mlp:
                total += sum(i * o for m, (i, o) in shapes.items() if m in MLP_MODULES)
            total += (4 if self.sandwich_norms else 2) * self.hidden_size
            if self.is_sparse(layer) and self.moe_beside_mlp:  # 3 norms, router scales
                total += 4 * self.hidden_size + self.num_experts
        total += self.layer_scalar * self.num_layers
        width, n = self.per_layer_input_size, self.num_layers
        if width:  # the packed embedding, its projection and norm; each layer's gate,
            # projection and norm
            total += n * width * (self.per_layer_vocab_size + self.hidden_size) + width
            total += n * (2 * width * self.hidden_size + self.hidden_size)
        return total

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of one expert's gate, up and down projections, by
        their LoRA module names ({} for a dense model)."""
        if not self.num_experts:
            return {}
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"expert_gate_proj": (h, i), "expert_up_proj": (h, i), "expert_down_proj": (i, h)}

    def module_path(self, layer: int, module: str, prefix: str | None = None) -> str:
        """Where a checkpoint keeps projection `module` of `layer` (its tensors' names less
        the .weight / .qweight suffix); `prefix`: the checkpoint's, else the first one."""
        group = "self_attn" if module in ATTENTION_MODULES else "mlp"
        if module in LINEAR_MODULES:
            group = "linear_attn"
        prefix = self.weight_prefixes[0] if prefix is None else prefix
        return f"{prefix}layers.{layer}.{group}.{module}"

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        linear = {} if self.linear_attention is None else self.linear_attention.module_shapes(h)
        return linear | {
            "q_proj": (h, self.q_proj_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def per_layer_input_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of Gemma 4's per-layer-input gate and projection
        in every layer ({} without per-layer inputs)."""
        h, w = self.hidden_size, self.per_layer_input_size
        if not w:
            return {}
        return {"per_layer_input_gate": (h, w), "per_layer_projection": (w, h)}

    def vocab_module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the LoRA-targetable vocabulary modules: the
        embedding (PEFT's lora_embedding_A [r, vocab], B [hidden, r]) and the head."""
        return {
            "embed_tokens": (self.vocab_size, self.hidden_size),
            "lm_head": (self.hidden_size, self.vocab_size),
        }

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every module an adapter may target: the projections, a fused
        checkpoint's fused ones (held fused: model/lora.py layer_groups), the vocabulary
        modules and one expert's."""
        shapes = self.module_shapes()
        fused = {
            name: (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
            for name, parts in self.fused_modules().items()
        }
        return (shapes | fused | self.vocab_module_shapes() | self.expert_shapes()
                | self.per_layer_input_shapes())  # fmt: skip

    def fused_modules(self) -> dict[str, tuple[str, ...]]:
        """The checkpoint's fused projections (name -> its parts, in row order)."""
        fused = {}
        if self.fused_qkv:
            fused["qkv_proj"] = ("q_proj", "k_proj", "v_proj")
        if self.fused_gate_up:
            fused["gate_up_proj"] = ("gate_proj", "up_proj")
        return fused


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ModelConfigError(f"{path}: not a JSON config ({e})") from None
    spec = spec_from_dict(cfg, source=str(path))
    if spec.expert_layout == "gemma4":
        spec = replace(spec, experts_unfused=_experts_unfused(model_dir))
    # generation_config.json may name more end-of-turn ids (Llama-3 Instruct's <|eot_id|>
    # lives only there): they end generation too
    extra = _as_tuple(read_generation_config(model_dir).get("eos_token_id"))
    eos = spec.eos_token_ids + tuple(t for t in extra if t not in spec.eos_token_ids)
    return replace(spec, eos_token_ids=eos)


def _experts_unfused(model_dir: str | Path) -> bool | None:
    """Whether the checkpoint in `model_dir` holds Gemma 4's experts un-fused per expert,
    from its tensor names (no tensor read); None without a checkpoint there."""
    names = tensor_files(model_dir)
    return None if names is None else any(map(UNFUSED_EXPERT.search, names))


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
    """The spec of a config.json's contents; ModelConfigError names what cannot be served."""
    quant = quant_scheme(cfg, source)
    cfg, family = family_config(cfg, source)
    return replace(base_spec(cfg, source, **family), quant=quant)


def base_spec(cfg: dict[str, Any], source: str, **family: Any) -> ModelSpec:
    """The fields every family reads the same way, plus the family's own ones."""
    arch = cfg.get("model_type")
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
            rope_theta=rope_theta(cfg),
            rope_scaling=family.pop("rope_scaling", None) or rope_scaling(cfg, source),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.pop("qkv_bias", False),
            sliding_window=family.pop("sliding_window", None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            **family,
        )
    except KeyError as e:
        raise ModelConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ModelConfigError(
            f"{source}: num_attention_heads={spec.num_heads} is not a multiple of "
            f"num_key_value_heads={spec.num_kv_heads}"
        )
    if len(spec.layer_types) not in (0, spec.num_layers):
        raise ModelConfigError(
            f"{source}: layer_types has {len(spec.layer_types)} entries for "
            f"{spec.num_layers} layers"
        )
    _check_kv_sources(spec, source)
    if spec.num_experts and not 0 < spec.num_experts_per_tok <= spec.num_experts:
        raise ModelConfigError(
            f"{source}: num_experts_per_tok={spec.num_experts_per_tok} must be in "
            f"1..{spec.num_experts} (the experts per layer)"
        )
    if spec.rotary_dim % 2 or spec.rotary_dim <= 0:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor={spec.partial_rotary_factor} gives an odd or "
            f"empty rotary dimension for head_dim={spec.head_dim}"
        )
    return spec


def _check_kv_sources(spec: ModelSpec, source: str) -> None:
    """Refuses a KV sharing map a cache could not hold: every source owns its pool."""
    if not spec.kv_sources:
        return
    if len(spec.kv_sources) != spec.num_layers:
        raise ModelConfigError(
            f"{source}: {len(spec.kv_sources)} KV sources for {spec.num_layers} layers"
        )
    for layer, src in enumerate(spec.kv_sources):
        if src is not None and (not 0 <= src <= layer or spec.kv_sources[src] != src):
            raise ModelConfigError(
                f"{source}: layer {layer} reads the KV of layer {src}, which does not own one"
            )


def _at(values: tuple[int, ...], layer: int, default: int) -> int:
    return values[layer] if values else default


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
