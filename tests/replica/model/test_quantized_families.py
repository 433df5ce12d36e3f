"""Quantized bases of the hybrid and Gemma 4 families served packed, adapters exact on top:
against transformers (+ PEFT) on the same weights dequantized, fp32 logits and greedy ids
in one mixed batch; TP=2 against TP=1; the memory plan against what the model holds.

Qwen3.5 / 3.6 as Qwen ships them in FP8 (128x128 blocks, `weight_scale_inv`): the
Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj, attention, MLP, experts and the
shared expert quantized; in_proj_b / in_proj_a (one row per value head), the conv, the
routers and the shared expert's gate dense, named in modules_to_not_convert. The
community's W4A16 (compressed-tensors pack-quantized, GPTQ) likewise. Checkpoints are
written by tests/quant_checkpoints.py in the published layouts (each packer checked
against its format's tooling in tests/kernels/test_quant_formats.py).

Gemma 4 as llm-compressor and the Hub's FP8 / W4A16 copies hold it: attention, the dense
MLP and each layer's per-layer-input gate and projection packed, per_layer_model_projection
packed or dense; Gemma 4's MoE experts either stacked dense (a quantizer that targets
Linear modules skips the 3D stacks) or un-fused per expert and packed.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from kernels import AwqInt4, Fp8Weight, GptqInt4, PackQuantizedInt4
from replica.executor import memory_plan as mp
from replica.model.decoder import CausalLM
from replica.model.quant_weights import PackedLinear
from replica.model.spec import ModelConfigError, load_model_spec
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import TPShard
from tests.engines import held_bytes
from tests.oracle import (
    ATTENTION,
    EVERYTHING,
    LINEAR_ATTENTION,
    check_mixed_batch,
    family_adapters,
    hf_logits,
    hf_model,
    peft_adapter,
)
from tests.quant_checkpoints import PLE, quantize_dir, quantize_gemma4
from tests.replica.model.families import LOGIT_ATOL, MARGIN, engine_for, prompts, router_margin

NEW_TOKENS = 6
LM = "model.language_model.layers."
LINEAR_LAYERS = (0, 2)  # the tiny Qwen3.5's Gated DeltaNet layers
# Qwen's FP8 checkpoints keep each value head's b and a projections dense
SMALL_DENSE = tuple(f"{LM}{i}.linear_attn.{m}" for i in LINEAR_LAYERS
                    for m in ("in_proj_b", "in_proj_a"))  # fmt: skip
PACKED = {"fp8-block": Fp8Weight, "ct-fp8-channel": Fp8Weight, "ct-w4a16-g16": PackQuantizedInt4,
          "ct-w4a16-asym-g32": PackQuantizedInt4, "gptq-g32": GptqInt4}  # fmt: skip
EXPERTS = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def adapters_of(family: str, model_dir, root) -> dict:
    """peft adapters: one on the linear-attention projections only, and one on every
    linear module (Qwen3.5) or the stacked experts (Qwen3.5-MoE)."""
    linear = peft_adapter(model_dir, root / "linear", LINEAR_ATTENTION, r=8, alpha=16, seed=1)
    if family == "qwen35moe":
        other = peft_adapter(model_dir, root / "experts", [], r=4, alpha=8, seed=3, **EXPERTS)
        return {"linear": linear, "experts": other}
    every = EVERYTHING + LINEAR_ATTENTION
    return {"linear": linear, "all": peft_adapter(model_dir, root / "all", every, r=16,
                                                  alpha=8, seed=2)}  # fmt: skip


def parts_of(weight) -> list:
    return weight.parts if isinstance(weight, PackedLinear) else [weight]


# (family, format, modules left dense beside SMALL_DENSE): layer 2's in_proj_z and layer
# 1's shared-expert up dense too, so that one fused group mixes packed and dense parts
CASES = [
    ("qwen35", "fp8-block", ()),
    ("qwen35", "ct-w4a16-g16", (f"{LM}2.linear_attn.in_proj_z",)),
    ("qwen35", "gptq-g32", ()),
    ("qwen35moe", "fp8-block", (f"{LM}1.mlp.shared_expert.up_proj",)),
    ("qwen35moe", "ct-w4a16-asym-g32", ()),
]


@pytest.mark.parametrize(("family", "fmt", "dense"), CASES)
def test_quantized_qwen3_5_with_adapters_matches_transformers_on_its_dequantization(
    tmp_path, family, fmt, dense
):
    """The Gated DeltaNet's projections (and the MoE's shared expert) are held packed, the
    modules the config names dense stay dense, and the base with a linear-attention-only
    adapter and another one in one mixed batch equal transformers + PEFT on the same
    weights dequantized."""
    src = family_model_dir(family)
    model_dir = tmp_path / fmt
    oracle = quantize_dir(src, model_dir, fmt, SMALL_DENSE + dense)
    adapters = adapters_of(family, src, tmp_path)
    eng = engine_for(model_dir, adapters, lora_experts=True)  # Qwen3.5-MoE's "experts"
    model = eng.executor.model
    for i in LINEAR_LAYERS:
        mixer = model.layers[i].linear_attn
        in_parts = parts_of(mixer.in_proj.weight)
        qkv, z, b, a = in_parts
        assert isinstance(qkv, PACKED[fmt]) and isinstance(mixer.out_proj.weight, PackedLinear)
        assert isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor)  # ignored: dense
        assert isinstance(z, torch.Tensor) == (f"{LM}{i}.linear_attn.in_proj_z" in dense)
    if family == "qwen35moe":
        for i, layer in enumerate(model.layers):
            gate_up, down, _ = layer.mlp.shared
            kinds = [type(p) for p in parts_of(gate_up) + parts_of(down)]
            want = [PACKED[fmt]] * 3
            if f"{LM}{i}.mlp.shared_expert.up_proj" in dense:
                want[1] = torch.Tensor
            assert kinds == want, i
            assert [type(w) for w in layer.mlp.packed] == [PACKED[fmt]] * 3
        for adapter in (None, *adapters.values()):
            ref = hf_model(oracle, adapter, eager=True)
            for p in prompts(eng.spec.vocab_size):
                assert router_margin(ref, p, eng.spec.num_experts_per_tok) > MARGIN
    got = check_mixed_batch(eng, oracle, adapters, prompts(eng.spec.vocab_size), NEW_TOKENS)
    assert got["linear"] != got[None]  # the linear-attention adapter bites


# Linear-attention heads of 32: in_proj_qkv 256 rows, in_proj_z and out_proj 128, whole
# 128 blocks as in Qwen's models. transformers derives the block from the scale grid (rows
# / grid rows), which misreads a dimension that is not a multiple of 128 (the default tiny
# in_proj_qkv's 136 rows), where Qwen's, DeepSeek's and our reading is 128 (the oracle of
# the tests above).
WHOLE_BLOCKS = {"linear_key_head_dim": 32, "linear_num_value_heads": 4,
                "linear_value_head_dim": 32}  # fmt: skip


def test_block_fp8_qwen3_5_matches_transformers_loading_the_same_files(tmp_path):
    """Qwen's FP8 layout read by transformers' own FP8 integration (it dequantizes on a
    CPU): equal to us, base and adapters in one mixed batch, on the 5-token prompt (this
    model's 40-token one drifts from transformers by 1.4e-4 unquantized, more with the
    linear-attention adapter: too near the 2e-4 bar; the tests above run both)."""
    src = family_model_dir("qwen35", overrides=WHOLE_BLOCKS)
    model_dir = tmp_path / "fp8"
    quantize_dir(src, model_dir, "fp8-block", SMALL_DENSE)
    adapters = adapters_of("qwen35", src, tmp_path)
    eng = engine_for(model_dir, adapters)
    qkv = parts_of(eng.executor.model.layers[0].linear_attn.in_proj.weight)[0]
    assert isinstance(qkv, Fp8Weight) and qkv.scale.shape == (2, 1)
    check_mixed_batch(eng, model_dir, adapters, prompts(eng.spec.vocab_size)[:1], NEW_TOKENS)


def test_transformers_reads_a_block_fp8_qwen3_5_moe_as_we_do(tmp_path):
    """Qwen3.5-MoE's FP8 files (per-expert experts, the shared expert, the linear
    attention packed) mean to transformers what they mean to us: its logits on them equal
    its logits on kernels.dequantize of what we load (the other tests' oracle). (This
    model's own drift from transformers, unquantized, is too near the 2e-4 bar to run the
    engine against it here.)"""
    src = family_model_dir("qwen35moe", overrides=WHOLE_BLOCKS)
    model_dir = tmp_path / "fp8"
    oracle = quantize_dir(src, model_dir, "fp8-block", SMALL_DENSE)
    ref, dense = hf_model(model_dir, eager=True), hf_model(oracle, eager=True)
    for p in prompts(256):  # a misread block or scale moves logits by far more than this
        assert (hf_logits(ref, p) - hf_logits(dense, p)).abs().max() < LOGIT_ATOL


def test_awq_qwen3_5_with_adapters_matches_transformers_on_its_dequantization(tmp_path):
    """AutoAWQ's GEMM packing (8 output rows a word, whole groups of 32 inputs) on the
    Gated DeltaNet: 8 value heads make out_proj's inputs 96 (the default tiny's 72 is no
    multiple of 32). The 5-token prompt: this model's 40-token one drifts from
    transformers by 3.6e-4 unquantized (the default tiny's by 7.7e-5), over the bar."""
    src = family_model_dir("qwen35", overrides={"linear_num_value_heads": 8})
    model_dir = tmp_path / "awq"
    oracle = quantize_dir(src, model_dir, "awq-g32", SMALL_DENSE)
    adapters = adapters_of("qwen35", src, tmp_path)
    eng = engine_for(model_dir, adapters)
    in_parts = parts_of(eng.executor.model.layers[0].linear_attn.in_proj.weight)
    assert [type(p) for p in in_parts] == [AwqInt4, AwqInt4, torch.Tensor, torch.Tensor]
    check_mixed_batch(eng, oracle, adapters, prompts(eng.spec.vocab_size)[:1], NEW_TOKENS)


def test_a_quantized_attention_only_adapter_leaves_the_gated_deltanet_to_the_base(tmp_path):
    """LoRA on q/k/v/o of an FP8 Qwen3.5 (PEFT finds them on the attention layers only):
    equal to transformers + PEFT on the dequantized weights."""
    src = family_model_dir("qwen35")
    model_dir = tmp_path / "fp8"
    oracle = quantize_dir(src, model_dir, "fp8-block", SMALL_DENSE)
    adapters = {"attn": peft_adapter(src, tmp_path / "attn", ATTENTION, r=4, alpha=8, seed=3)}
    eng = engine_for(model_dir, adapters)
    check_mixed_batch(eng, oracle, adapters, prompts(eng.spec.vocab_size)[:1], NEW_TOKENS)


@pytest.mark.parametrize(
    ("family", "fmt"),
    [("qwen35", "fp8-block"), ("qwen35", "gptq-g32"), ("qwen35moe", "ct-w4a16-asym-g32"),
     ("qwen35moe", "ct-fp8-channel")],
)  # fmt: skip
def test_the_plan_counts_what_a_quantized_qwen3_5_holds(tmp_path, family, fmt):
    """The memory plan's weight bytes are what the model holds, packed linear attention and
    shared expert included, whole and (where the format splits) as rank 0 of 2."""
    model_dir = tmp_path / fmt
    quantize_dir(family_model_dir(family), model_dir, fmt, SMALL_DENSE)
    spec = load_model_spec(model_dir)
    model = CausalLM(model_dir, "cpu", torch.float32, spec=spec)
    assert mp.weight_bytes(spec, 1, torch.float32) == held_bytes(model)
    assert held_bytes(model) < held_bytes(CausalLM(family_model_dir(family), "cpu"))
    if fmt == "ct-fp8-channel":
        rank = TPRank(TPShard(spec, 0, 2), None)
        meta = CausalLM(model_dir, "meta", torch.bfloat16, None, spec, rank, "dummy")
        assert mp.weight_bytes(spec, 2, torch.bfloat16) == held_bytes(meta)


def test_a_tp_split_inside_a_linear_attention_block_is_refused_naming_it(tmp_path):
    """Two ranks would take in_proj_qkv's q rows 0:16 of a 128-row FP8 block: refused by
    the shard (so by the plan and the engine), naming the module; a channel-wise FP8
    Qwen3.5 splits."""
    model_dir = tmp_path / "fp8"
    quantize_dir(family_model_dir("qwen35"), model_dir, "fp8-block", SMALL_DENSE)
    spec = load_model_spec(model_dir)
    cut = (r"tp_size=2 cannot split the quantized model: model\.language_model\.layers\.0\."
           r"linear_attn\.in_proj_qkv \(fp8\): its output rows 0:16 on rank 0 cut its scale "
           r"blocks of 128")  # fmt: skip
    with pytest.raises(ModelConfigError, match=cut):
        TPShard(spec, 0, 2)
    with pytest.raises(ModelConfigError, match="in_proj_qkv"):
        mp.weight_bytes(spec, 2, torch.bfloat16)
    quantize_dir(family_model_dir("qwen35"), tmp_path / "ch", "ct-fp8-channel", SMALL_DENSE)
    TPShard(load_model_spec(tmp_path / "ch"), 1, 2)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize(
    ("family", "fmt", "overrides"),
    [("qwen35", "ct-w4a16-g16", {"linear_value_head_dim": 16}),
     ("qwen35moe", "ct-fp8-channel", {}), ("gemma4", "ct-w4a16-g16", {})],
)  # fmt: skip
def test_quantized_hybrid_and_gemma4_on_two_ranks_equal_one(
    local_ray, tmp_path, family, fmt, overrides
):
    """Packed Gated DeltaNet projections on 2 ranks, each holding its key heads' q and k
    rows and its value heads' v, z, b, a rows of the packed in_proj tensors and its
    columns of out_proj (groups of 16 whole: value heads of 16 here), and Qwen3.5-MoE's
    packed shared expert split like the dense MLP; Gemma 4's packed per-layer-input
    projections whole on each rank: logits and a staggered mixed batch with adapters (the
    linear-attention one, Gemma 4's on everything) equal TP=1."""
    from tests.tp_checks import check_tp2_equals_tp1

    src = family_model_dir(family, overrides=overrides)
    model_dir = tmp_path / fmt
    quantize_dir(src, model_dir, fmt, SMALL_DENSE + (PLE,))
    if family == "gemma4":
        adapters = family_adapters(family, src, tmp_path)
    else:
        adapters = adapters_of(family, src, tmp_path)
    check_tp2_equals_tp1(model_dir, adapters, f"{family} {fmt}", lora_experts=True)


GEMMA4_CASES = [("gemma4", "fp8-block", True), ("gemma4", "ct-w4a16-g16", False),
                ("gemma4moe", "fp8-block", False)]  # fmt: skip


@pytest.mark.parametrize(("family", "fmt", "ple"), GEMMA4_CASES)
def test_quantized_gemma4_with_adapters_matches_transformers_on_its_dequantization(
    tmp_path, family, fmt, ple
):
    """Gemma 4 with its attention (the KV-sharing layers have no k/v to pack), MLP and
    per-layer-input projections packed (and per_layer_model_projection; on the MoE, every
    expert, un-fused): base, an attention adapter and one on everything (the per-layer
    projections and the experts included) in one mixed batch equal transformers + PEFT
    on the dequantized weights; the plan counts what the model holds."""
    src = family_model_dir(family)
    model_dir = tmp_path / fmt
    oracle = quantize_gemma4(src, model_dir, fmt, ple)
    adapters = family_adapters(family, src, tmp_path)
    eng = engine_for(model_dir, adapters, lora_experts=True)  # the MoE's "all": experts too
    model = eng.executor.model
    for layer in model.layers:
        block = layer.per_layer_input
        for lin in (layer.qkv_proj, layer.mlp.gate_up_proj, block.gate, block.projection):
            assert isinstance(lin.weight, PackedLinear)
        if layer.experts is not None:
            assert [type(w) for w in layer.experts.packed] == [PACKED[fmt]] * 3
    assert isinstance(model.per_layer_inputs.projection, PackedLinear) == ple
    spec = eng.spec
    assert mp.weight_bytes(spec, 1, torch.float32) == held_bytes(model)
    check_mixed_batch(eng, oracle, adapters, prompts(spec.vocab_size), NEW_TOKENS)


@pytest.mark.parametrize("fmt", ["ct-w4a16-g16", "fp8-block", "ct-fp8-channel"])
def test_the_plan_counts_gemma4_moe_experts_as_the_checkpoint_holds_them(tmp_path, fmt):
    """Gemma 4 MoE experts un-fused per expert and packed (llm-compressor's layout, read
    from the index's tensor names) and stacked dense (a Linear-targeting quantizer's,
    read from the header's): the plan's weight bytes are what the model holds, at TP=1
    and as rank 0 of 2 where the format splits; from config.json alone, stacked."""
    src = family_model_dir("gemma4moe")
    unfused, stacked = tmp_path / "unfused", tmp_path / "stacked"
    quantize_gemma4(src, unfused, fmt, ple=False)
    quantize_dir(src, stacked, fmt, (PLE,))
    shard = unfused / "model-00001-of-00001.safetensors"
    (unfused / "model.safetensors").rename(shard)
    index = {"metadata": {}, "weight_map": {k: shard.name for k in load_file(shard)}}
    (unfused / "model.safetensors.index.json").write_text(json.dumps(index))
    held = {}
    for model_dir, unfused_experts in ((unfused, True), (stacked, False)):
        spec = load_model_spec(model_dir)
        assert spec.experts_unfused is unfused_experts, model_dir.name
        held[model_dir] = held_bytes(CausalLM(model_dir, "cpu", torch.float32, spec=spec))
        assert mp.weight_bytes(spec, 1, torch.float32) == held[model_dir], model_dir.name
        if fmt != "fp8-block":  # 128-row blocks: the tiny model's q rows cannot split
            rank = TPRank(TPShard(spec, 0, 2), None)
            model = CausalLM(model_dir, "cpu", torch.float32, None, spec, rank)
            assert mp.weight_bytes(spec, 2, torch.float32) == held_bytes(model), model_dir.name
    assert held[unfused] < held[stacked]
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(unfused / "config.json", config_only)
    spec = load_model_spec(config_only)
    assert spec.experts_unfused is None
    assert mp.weight_bytes(spec, 1, torch.float32) == held[stacked]


@pytest.mark.parametrize(
    ("family", "router"),
    [("qwen35moe", f"{LM}0.mlp.gate"), ("gemma4moe", "model.layers.0.router.proj")],
)
def test_a_quantized_router_is_refused_naming_it(tmp_path, family, router):
    """Routers are read unquantized (every published quantized MoE keeps them so): one
    stored in block FP8 is refused by its path, not read as codes or reported missing.
    (Gemma 4's experts here stay stacked and dense, as a Linear-targeting quantizer leaves
    them: that loads.)"""
    from kernels.quant_pack import quantize_fp8
    from replica.model.weights import WeightLoadError

    model_dir = tmp_path / "fp8"
    quantize_dir(family_model_dir(family), model_dir, "fp8-block", (PLE,))
    CausalLM(model_dir)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    q = quantize_fp8(tensors.pop(f"{router}.weight"), (128, 128))
    tensors |= {f"{router}.weight": q.weight, f"{router}.weight_scale_inv": q.scale}
    save_file(tensors, path)
    with pytest.raises(WeightLoadError, match=f"the router '{router}' is stored quantized"):
        CausalLM(model_dir)
