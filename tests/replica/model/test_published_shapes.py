"""Every served family read and planned at its real published shapes, transformers the oracle.

The tiny models of cluster/demo/families.py test the decoder's numerics; a deployment reads
a Hub config.json at flagship shapes instead (nested rope_parameters, layer_types, per-layer
head dims, Gemma 4's per-layer inputs over a 262k vocabulary, Qwen3.5's text_config, gpt-oss's
MXFP4 quantization_config, MoE fields). For each config in tests/published_configs/ (where
each comes from: its README.md), transformers builds the language model on the meta device
(no memory, so a 400B model is fine) and its parameters are the oracle for our spec's count,
every layer's projection shapes and the memory plan's weight bytes. Vision towers, audio
towers and multi-token-prediction layers are not served and not built.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from functools import cache

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replica.config import EngineConfig
from replica.executor.memory_plan import (
    MemoryPlanError,
    kv_block_bytes,
    local_spec,
    plan_memory,
    weight_bytes,
)
from replica.model.decoder import CausalLM
from replica.model.hf_config import ModelConfigError
from replica.model.kv_cache import KVCache
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import ModelSpec, load_model_spec
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import TPShard
from tests.engines import held_bytes
from tests.model_dirs import PUBLISHED

NAMES = sorted(p.name for p in PUBLISHED.iterdir() if (p / "config.json").is_file())
GiB, GB = 2**30, 10**9
META = torch.device("meta")
GPUS = {"H100 80GiB": 80 * GiB, "H200 141GB": 141 * GB}
# What ModelSpec.num_parameters leaves aside (weight_bytes adds them): biases, gpt-oss's
# expert biases and attention sinks.
NOT_COUNTED = re.compile(r"(\.bias|_proj_bias|\.sinks)$")
# The linear-attention layer's gated norm stays in the model's dtype; every other norm of a
# Gemma-style model is held in fp32 (weight_bytes' docstring)
NORM = re.compile(r"norm(_\d)?\.weight$")
MXFP4_EXPERTS = re.compile(r"experts\.(gate_up|down)_proj$")


@cache
def hf_tensors(name: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor transformers' language model of `name` holds in its
    checkpoint: parameters (tied ones once) and persistent buffers (Gemma 4's layer
    scalars), built on the meta device from the config's text part."""
    config = AutoConfig.from_pretrained(PUBLISHED / name)
    text = getattr(config, "text_config", None) or config
    if hasattr(text, "quantization_config"):  # the dequantized model: MXFP4 needs a GPU
        del text.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    tensors = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for module_name, module in model.named_modules():
        for b, buf in module._buffers.items():
            if buf is not None and b not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{b}"] = tuple(buf.shape)
    return tensors


@cache
def spec_of(name: str) -> ModelSpec:
    return load_model_spec(PUBLISHED / name)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rope_table_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """One cos and one sin table per distinct (rope, rotary_dim), weight_bytes' extra."""
    ropes: list = []
    for i in range(spec.num_layers):
        key = (spec.rope(i), spec.layer(i).rotary_dim)
        if key not in ropes:
            ropes.append(key)
    return sum(2 * spec.max_position_embeddings * dim for _, dim in ropes) * dtype.itemsize


def held_in_fp32(spec: ModelSpec, name: str) -> bool:
    """Whether our model holds checkpoint tensor `name` in fp32 rather than the dtype."""
    if name.endswith((".sinks", ".A_log")):
        return True
    gemma_norms = spec.gemma_norm or spec.norm_fp32_weight
    return gemma_norms and bool(NORM.search(name)) and ".linear_attn." not in name


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_transformers(name):
    hf = sum(numel(s) for n, s in hf_tensors(name).items() if not NOT_COUNTED.search(n))
    assert spec_of(name).num_parameters() == hf


@pytest.mark.parametrize("name", NAMES)
def test_every_layers_projections_have_transformers_shapes(name):
    spec, hf = spec_of(name), hf_tensors(name)
    prefix = "model."
    for layer in range(spec.num_layers):
        own = spec.layer(layer)
        shapes = own.module_shapes() | {
            fused: (own.module_shapes()[parts[0]][0],
                    sum(own.module_shapes()[p][1] for p in parts))
            for fused, parts in own.fused_modules().items()
        }  # fmt: skip
        if spec.is_linear(layer):
            modules = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
        elif spec.fused_qkv:
            modules = ["qkv_proj", "o_proj"]
        else:
            modules = [*spec.qkv_modules(layer), "o_proj"]
        if not spec.is_sparse(layer) or spec.moe_beside_mlp:
            modules += ["gate_up_proj", "down_proj"] if spec.fused_gate_up else \
                ["gate_proj", "up_proj", "down_proj"]  # fmt: skip
        for module in modules:
            path = f"{spec.module_path(layer, module, prefix)}.weight"
            k, n = shapes[module]
            assert hf[path] == (n, k), f"{path}: ours {(n, k)}, transformers {hf[path]}"
        attention = [m for m in ("q_proj", "k_proj", "v_proj", "qkv_proj")
                     if f"{prefix}layers.{layer}.self_attn.{m}.weight" in hf]  # fmt: skip
        if not spec.is_linear(layer):  # no projection transformers has that we do not read
            assert set(attention) <= set(modules), (layer, attention, modules)


@pytest.mark.parametrize("name", NAMES)
def test_weight_bytes_at_tp1_are_transformers_tensors_and_named_extras(name):
    """Weights in bf16, dequantized: every tensor transformers holds, in bf16 but the fp32
    ones weight_bytes names, plus the rope tables; nothing else."""
    spec, dtype = replace(spec_of(name), quant=None), torch.bfloat16
    tensors = hf_tensors(name)
    expected = sum(numel(s) * (4 if held_in_fp32(spec, n) else 2) for n, s in tensors.items())
    assert weight_bytes(spec, 1, dtype) == expected + rope_table_bytes(spec, dtype)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("gpt-oss")])
def test_gpt_oss_weight_bytes_hold_the_experts_in_mxfp4(name):
    """The Hub's gpt-oss keeps its experts' weights in MXFP4 (a byte per two values and a
    scale byte per 32: 17 bytes per 32 values), the rest in bf16."""
    spec, dtype = spec_of(name), torch.bfloat16
    assert spec.quant is not None and spec.quant.method == "mxfp4"
    expected = sum(
        numel(s) * 17 // 32 if MXFP4_EXPERTS.search(n) else
        numel(s) * (4 if held_in_fp32(spec, n) else 2)
        for n, s in hf_tensors(name).items()
    )  # fmt: skip
    assert weight_bytes(spec, 1, dtype) == expected + rope_table_bytes(spec, dtype)


def vllm_splits(spec: ModelSpec, tp: int) -> bool:
    """Whether vLLM serves the model at `tp`: its attention heads (and a hybrid model's
    linear-attention heads) divide evenly; KV heads fewer than tp are replicated."""
    heads = [spec.num_heads]
    if spec.linear_attention is not None:
        heads += [spec.linear_attention.num_key_heads, spec.linear_attention.num_value_heads]
    return all(h % tp == 0 for h in heads)


@pytest.mark.parametrize("name", NAMES)
def test_every_tp_size_and_gpu_plans_or_refuses_in_one_line(name):
    """At tp 1/2/4/8 on an H100 and an H200: a plan, or one line saying what to change; a
    tp vLLM serves the model at is refused only for memory (gpt-oss's MXFP4 experts at 4
    and 8 too: a rank holds the 32-group its 720 or 360 columns cut)."""
    spec = spec_of(name)
    for tp in (1, 2, 4, 8):
        config = EngineConfig(model=str(PUBLISHED / name), device="cuda", tp_size=tp)
        for gpu, size in GPUS.items():
            try:
                plan = plan_memory(spec, config, torch.bfloat16, size)
            except (MemoryPlanError, ModelConfigError) as e:
                line = str(e)
                assert "\n" not in line and line, (name, tp, gpu)
                assert not (isinstance(e, ModelConfigError) and vllm_splits(spec, tp)), line
                continue
            assert plan.weights_bytes_per_gpu > 0 and plan.kv_cache_tokens > 0
            assert plan.max_model_len >= 1


@pytest.mark.parametrize("name", NAMES)
def test_a_tp_shard_splits_every_layer_into_the_whole(name):
    """At every tp the model splits at, the ranks' heads and MLP columns add up to the
    model's, layer by layer (Gemma 4's full layers with their own head_dim and KV heads),
    and KV heads fewer than the ranks are replicated, one a rank."""
    spec = replace(spec_of(name), quant=None)
    for tp in (2, 4, 8):
        try:
            shard = TPShard(spec, 0, tp)
        except ModelConfigError:
            assert not vllm_splits(spec, tp), f"{name} tp {tp}"
            continue
        for layer in range(spec.num_layers):
            local, own = shard.layer(layer).local_spec, spec.layer(layer)
            assert local.num_heads * tp == own.num_heads
            assert local.head_dim == own.head_dim
            assert local.intermediate_size * tp == own.intermediate_size
            assert local.num_kv_heads == max(own.num_kv_heads // tp, 1)  # replicated below 1


# How a rank holds each of transformers' tensors (Megatron's split, as vLLM serves it):
# column-parallel ones by their rows, row-parallel ones by their input columns, the stacked
# experts by their intermediate columns, the vocabulary by rows padded to a multiple of tp;
# KV heads fewer than tp replicated; the rest (norms, routers, Gemma 4's per-layer inputs
# and layer scalars, o_proj's bias, added after the all-reduce) whole on every rank.
BY_ROWS = re.compile(
    r"(q_proj\.(weight|bias)|(gate|up|gate_up)_proj\.weight|in_proj_\w+\.weight|"
    r"conv1d\.weight|A_log|dt_bias|sinks|experts\.(gate_up|down)_proj|gate_up_proj_bias)$"
)
BY_COLUMNS = re.compile(r"(o_proj|down_proj|out_proj)\.weight$")
KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")
LAYER = re.compile(r"\.layers\.(\d+)\.")


def rank0_numel(spec: ModelSpec, name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of transformers' tensor `name` that rank 0 of `tp` holds."""
    n = numel(shape)
    if VOCAB.search(name):
        return -(-shape[0] // tp) * shape[1]
    match = LAYER.search(name)
    own = spec.layer(int(match.group(1))) if match else spec
    if KV.search(name):
        return n * max(own.num_kv_heads // tp, 1) // own.num_kv_heads
    if name.endswith("self_attn.qkv_proj.weight"):  # Phi-3's fused q, k, v
        q, kv = own.q_size, own.kv_size
        return (q // tp + 2 * kv * max(own.num_kv_heads // tp, 1) // own.num_kv_heads) * shape[1]
    if BY_ROWS.search(name) or BY_COLUMNS.search(name):
        return n // tp
    return n


@pytest.mark.parametrize("name", NAMES)
def test_weight_bytes_per_rank_are_rank0s_share_of_transformers_tensors(name):
    spec, dtype = replace(spec_of(name), quant=None), torch.bfloat16
    tensors = hf_tensors(name)
    for tp in (2, 4, 8):
        if not vllm_splits(spec, tp):
            continue
        expected = sum(rank0_numel(spec, n, s, tp) * (4 if held_in_fp32(spec, n) else 2)
                       for n, s in tensors.items())  # fmt: skip
        got = weight_bytes(spec, tp, dtype) - rope_table_bytes(spec, dtype)
        assert got == expected, f"tp {tp}: ours {got:,} B, rank 0's share {expected:,} B"


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("gpt-oss")])
def test_gpt_oss_mxfp4_experts_per_rank_are_whole_groups_of_rank0s_columns(name):
    """At tp 2/4/8 rank 0 owns the first 1440/720/360 of each expert's 2880 columns and
    holds them rounded up to whole MXFP4 groups of 32 (1440, 736, 384): those columns of
    the Hub's expert stacks (17 bytes per 32 values) and of their gate/up biases, the rest
    its share as unquantized. The shares are named by the stacks' paths (the checkpoint
    has no per-expert ones)."""
    from replica.model.quant_shares import packed_shares

    spec, dtype = spec_of(name), torch.bfloat16
    whole = spec.moe_intermediate_size
    paths = {share.path for share in packed_shares(TPShard(spec, 0, 4))}
    assert paths == {f"model.layers.{layer}.mlp.experts.{stack}"
                     for layer in range(spec.num_layers)
                     for stack in ("gate_up_proj", "down_proj")}  # fmt: skip
    for tp, held in ((2, 1440), (4, 736), (8, 384)):
        assert TPShard(spec, 0, tp).expert_held_range == (0, held)
        expected = 0
        for n, s in hf_tensors(name).items():
            if MXFP4_EXPERTS.search(n):
                expected += numel(s) * held // whole * 17 // 32
            elif n.endswith("experts.gate_up_proj_bias"):
                expected += numel(s) * held // whole * dtype.itemsize
            else:
                size = 4 if held_in_fp32(spec, n) else dtype.itemsize
                expected += rank0_numel(spec, n, s, tp) * size
        got = weight_bytes(spec, tp, dtype) - rope_table_bytes(spec, dtype)
        assert got == expected, f"tp {tp}: ours {got:,} B, rank 0's share {expected:,} B"


@pytest.mark.parametrize("name", NAMES)
def test_kv_block_bytes_hold_each_kv_layers_keys_and_values(name):
    """A block holds, per layer that keeps KV (transformers' layers with a k_proj of their
    own, not linear attention), block_size tokens of keys and values of that layer's
    k_proj width, a rank's share of its KV heads (replicated below one head per rank)."""
    spec, hf, block = replace(spec_of(name), quant=None), hf_tensors(name), 16
    for tp in (1, 2, 4, 8):
        if not vllm_splits(spec, tp):
            continue
        per_token = 0
        for layer in range(spec.num_layers):
            k_proj = f"model.layers.{layer}.self_attn.k_proj.weight"
            qkv = hf.get(f"model.layers.{layer}.self_attn.qkv_proj.weight")
            own = spec.layer(layer)
            if k_proj in hf or qkv is not None:
                width = hf[k_proj][0] if k_proj in hf else own.kv_size  # Phi-3: fused
                per_token += 2 * width * max(own.num_kv_heads // tp, 1) // own.num_kv_heads
        assert kv_block_bytes(spec, tp, block, torch.bfloat16) == per_token * block * 2, tp


def test_a_model_whose_weights_fit_but_not_with_its_working_memory_is_told_what_to_lower():
    """Qwen3.6-35B-A3B on one H100: 64.6 GiB of weights fit the 71.5 GiB budget, but not
    with the activations and the linear-attention state pool of 64 sequences; the refusal
    names the settings that size them, and lowering them as it says (and the adapters' rank:
    one of rank 64 over 256 experts in 40 layers is 9.5 GiB) gives a plan."""
    model = PUBLISHED / "Qwen3.6-35B-A3B"
    spec, size = spec_of(model.name), GPUS["H100 80GiB"]
    config = EngineConfig(model=str(model), device="cuda")
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(spec, config, torch.bfloat16, size)
    assert "state pool" in str(refused.value) and "before any KV cache" in str(refused.value)
    assert "lower engine.max_num_batched_tokens or engine.max_num_seqs" in str(refused.value)
    lower = EngineConfig(
        model=str(model), device="cuda", max_num_seqs=16, max_model_len=32768, max_lora_rank=8
    )
    assert plan_memory(spec, lower, torch.bfloat16, size).kv_cache_tokens >= 32768


# What a config must state; everything else a family's config class defaults
SHAPE_KEYS = {
    "model_type", "architectures", "text_config", "quantization_config", "layer_types",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "enable_moe_block", "top_k_experts", "global_head_dim", "num_global_key_value_heads",
    "attention_k_eq_v", "num_kv_shared_layers", "hidden_size_per_layer_input",
    "use_double_wide_mlp", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim",
}  # fmt: skip


def shapes_only(cfg: dict) -> dict:
    return {k: shapes_only(v) if k == "text_config" else v
            for k, v in cfg.items() if k in SHAPE_KEYS}  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_a_config_of_shapes_alone_is_read_as_transformers_fills_it_in(name, tmp_path):
    """A config.json that states only the shapes (hand-written, or trimmed) is read with
    transformers' defaults for the rest: saved back by transformers 5, every default
    written out (rope_parameters and all), it gives the same spec. Token ids aside: the
    generation config states them."""
    cfg = shapes_only(json.loads((PUBLISHED / name / "config.json").read_text()))
    short, full = tmp_path / "short", tmp_path / "full"
    short.mkdir()
    (short / "config.json").write_text(json.dumps(cfg))
    AutoConfig.from_pretrained(short).save_pretrained(full)
    ours, theirs = (asdict(load_model_spec(d)) for d in (short, full))
    differ = {k: (ours[k], theirs[k]) for k in ours
              if ours[k] != theirs[k] and k not in ("bos_token_id", "eos_token_ids")}  # fmt: skip
    assert not differ


@pytest.mark.parametrize("name", NAMES)
def test_a_published_config_saved_by_transformers_5_reads_the_same(name, tmp_path):
    """transformers 5 saves rope_parameters (per layer type for Gemma) where the Hub's
    4.x-era files wrote rope_theta and rope_scaling: a checkpoint saved again reads the same.
    Token ids aside (transformers 5 moves a multimodal file's to the generation config)."""
    AutoConfig.from_pretrained(PUBLISHED / name).save_pretrained(tmp_path)
    ours, saved = asdict(spec_of(name)), asdict(load_model_spec(tmp_path))
    differ = {k: (ours[k], saved[k]) for k in ours
              if ours[k] != saved[k] and k not in ("bos_token_id", "eos_token_ids")}  # fmt: skip
    assert not differ


@pytest.mark.slow  # a minute on two cores: every layer of every flagship, at each tp
@pytest.mark.parametrize("name", NAMES)
def test_our_model_at_real_shapes_holds_what_the_plan_counts(name):
    """Our CausalLM built on the meta device (dummy weights from config.json, no memory),
    whole and as rank 0 at every tp it splits at, quantized experts packed as shipped:
    the bytes it holds, its KV pools and its adapter arenas are the plan's (with
    engine.lora_experts and without)."""
    spec, model_dir = spec_of(name), PUBLISHED / name
    for tp in (1, 2, 4, 8):
        try:
            shard = TPShard(spec, 0, tp)
        except ModelConfigError:
            continue
        rank = None if tp == 1 else TPRank(shard, None)
        model = CausalLM(model_dir, META, torch.bfloat16, None, spec, rank, "dummy")
        assert held_bytes(model) == weight_bytes(spec, tp, torch.bfloat16), f"tp {tp}"
        kv = KVCache(local_spec(spec, tp), 3, 16, META, torch.bfloat16)
        held = sum(t.numel() * t.element_size() for t in kv.pools)
        assert held == 3 * kv_block_bytes(spec, tp, 16, torch.bfloat16), f"tp {tp}"
        shapes = None if tp == 1 else shard.lora_shapes
        for experts in (False, True):
            arenas = LoRASlotBuffers(spec, 3, 16, META, torch.bfloat16, shapes, experts=experts)
            config = EngineConfig(model=str(model_dir), max_lora_rank=16, tp_size=tp,
                                  kv_cache_bytes=1 << 20, adapters={"num_slots": 3},
                                  lora_experts=experts)  # fmt: skip
            plan = plan_memory(spec, config, torch.bfloat16, 1 << 50)
            assert plan.adapter_memory_bytes == arenas.nbytes(), f"tp {tp}, experts {experts}"
