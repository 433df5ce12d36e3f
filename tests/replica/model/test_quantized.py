"""Quantized bases served packed, adapters exact on top: each format against transformers
(+ PEFT) on the same weights, fp32 logits and greedy ids in one mixed batch.

Block FP8 (Qwen's layout) is loaded by transformers itself from the same files (its FP8
integration dequantizes on a CPU); the other formats are written by tests/quant_checkpoints.py
in their published layouts and compared with transformers on their dequantization (each
packer and dequantizer is checked against the format's own tooling in
tests/kernels/test_quant_formats.py). The device holds the packed tensors: its weight bytes
are the checkpoint's, and the memory plan counts them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from cluster.demo.families import family_model_dir
from kernels import AwqInt4, Fp8Weight, GptqInt4, Nf4Weight, PackQuantizedInt4
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.executor import memory_plan as mp
from replica.model.decoder import CausalLM
from replica.model.quant_weights import PackedLinear
from replica.model.spec import ModelConfigError, load_model_spec, spec_from_dict
from replica.model.tp_shard import TPShard
from tests.conftest import tiny_assets
from tests.oracle import (
    ATTENTION,
    check_mixed_batch,
    family_adapters,
    hf_logits,
    hf_model,
    peft_adapter,
)
from tests.quant_checkpoints import quantize_dir

NEW_TOKENS = 6
# Block FP8 where its 128x128 blocks bite: every projection spans several blocks
BLOCK_QWEN3 = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
PACKED = {
    "fp8-block": Fp8Weight,
    "ct-fp8-channel": Fp8Weight,
    "ct-fp8-tensor-static": Fp8Weight,
    "ct-w4a16-g16": PackQuantizedInt4,
    "ct-w4a16-asym-g32": PackQuantizedInt4,
    "ct-w4a16-channel": PackQuantizedInt4,
    "gptq-g32": GptqInt4,
    "gptq-g16-desc-act": GptqInt4,
    "awq-g32": AwqInt4,
    "bnb-nf4": Nf4Weight,
    "bnb-nf4-nested": Nf4Weight,
}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 19)]


def engine_for(model_dir, adapters: dict, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_bytes=16 << 20,
                       block_size=4, max_num_batched_tokens=16, **kw)  # fmt: skip
    eng = LLMEngine(cfg)
    for name, path in adapters.items():
        eng.load_adapter(name, path)
    return eng


def adapters_of(model_dir, root) -> dict:
    """A rank-8 adapter on attention and a rank-16 one on everything, written by peft."""
    every = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
    return {"attn": peft_adapter(model_dir, root / "attn", ATTENTION, r=8, alpha=16, seed=1),
            "all": peft_adapter(model_dir, root / "all", every, r=16, alpha=8, seed=2)}  # fmt: skip


def packed_layers(model: CausalLM) -> list:
    return [
        part
        for layer in model.layers
        for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if isinstance(lin.weight, PackedLinear)
        for part in lin.weight.parts
    ]


def test_block_fp8_qwen3_matches_transformers_loading_the_same_files(tmp_path):
    """The issue's example: a Qwen3 in Qwen's block-FP8 layout (float8_e4m3fn weights,
    fp32 weight_scale_inv per 128x128 block) used to load as if its codes were weights.
    Served packed, its logits and greedy ids equal transformers loading the same files, base
    and two PEFT adapters in one mixed batch."""
    src = family_model_dir("qwen3", overrides=BLOCK_QWEN3)
    model_dir = tmp_path / "qwen3-fp8"
    quantize_dir(src, model_dir, "fp8-block")
    adapters = adapters_of(src, tmp_path)
    eng = engine_for(model_dir, adapters)
    parts = packed_layers(eng.executor.model)
    assert len(parts) == 2 * 7 and all(isinstance(p, Fp8Weight) for p in parts)
    assert parts[0].scale.shape == (2, 2)  # q_proj [256, 256]: four blocks, four scales
    check_mixed_batch(eng, model_dir, adapters, prompts(eng.spec.vocab_size), NEW_TOKENS)


# Each format once on Qwen3 (q/k norms, head_dim 24 x 4 heads != hidden) or Llama; the
# modules in `dense` are left unquantized and named in the config's ignore list.
CASES = [
    ("qwen3", "ct-fp8-channel", ()),
    ("qwen3", "ct-fp8-tensor-static", ("model.layers.1.mlp.down_proj",)),
    ("qwen3", "ct-w4a16-g16", ()),
    ("llama", "ct-w4a16-asym-g32", ("model.layers.0.self_attn.k_proj",)),
    ("qwen3", "ct-w4a16-channel", ()),
    ("llama", "gptq-g32", ()),
    ("qwen3", "gptq-g16-desc-act", ()),
    ("llama", "awq-g32", ("model.layers.1.mlp.gate_proj",)),
    # Phi-3's fused qkv_proj / gate_up_proj: each part's rows of the packed tensor
    ("phi3", "gptq-g32", ()),
    ("gemma2", "ct-fp8-channel", ()),
    ("llama", "bnb-nf4", ("model.layers.0.mlp.down_proj",)),
    ("qwen3", "bnb-nf4-nested", ()),
]


@pytest.mark.parametrize(("family", "fmt", "dense"), CASES)
def test_format_with_adapters_matches_transformers_on_its_dequantization(
    tmp_path, family, fmt, dense
):
    if family == "llama":
        assets = tiny_assets("llama")
        src, adapters = assets.model_dir, dict(list(assets.adapters.items())[:1])
    else:
        src = family_model_dir(family)
        adapters = {"all": family_adapters(family, src, tmp_path)["all"]}
    model_dir = tmp_path / fmt
    oracle = quantize_dir(src, model_dir, fmt, dense)
    eng = engine_for(model_dir, adapters)
    model = eng.executor.model
    packed = [p for p in packed_layers(model) if not isinstance(p, torch.Tensor)]
    assert len(packed) == 2 * 7 - len(dense)  # the ignored modules, and only they, stay dense
    assert all(isinstance(p, PACKED[fmt]) for p in packed)
    check_mixed_batch(eng, oracle, adapters, prompts(eng.spec.vocab_size), NEW_TOKENS)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-channel", "ct-w4a16-asym-g32",
                                 "gptq-g16-desc-act", "awq-g32", "bnb-nf4-nested"])  # fmt: skip
def test_device_bytes_are_the_checkpoints_and_the_plan_counts_them(tmp_path, fmt):
    """The weights the model holds are the checkpoint's packed tensors (float8 scales in
    fp32), byte for byte what the memory plan counts, whole and as rank 0 of 2."""
    from tests.engines import held_bytes

    src = tiny_assets("llama").model_dir
    model_dir = tmp_path / fmt
    quantize_dir(src, model_dir, fmt)
    spec = load_model_spec(model_dir)
    model = CausalLM(model_dir, "cpu", torch.float32, spec=spec)
    assert mp.weight_bytes(spec, 1, torch.float32) == held_bytes(model)
    dense = CausalLM(src, "cpu", torch.float32)
    assert held_bytes(model) < held_bytes(dense)
    from replica.model.tp_layers import TPRank

    if fmt not in ("fp8-block", "bnb-nf4-nested"):  # blocks a split would cut: below
        rank = TPRank(TPShard(spec, 0, 2), None)
        meta = CausalLM(model_dir, "meta", torch.bfloat16, None, spec, rank, "dummy")
        assert mp.weight_bytes(spec, 2, torch.bfloat16) == held_bytes(meta)


def test_a_tp_split_that_cuts_a_block_or_group_is_refused_naming_the_layer(tmp_path):
    """Tiny Qwen3 in 128x128 FP8 blocks: 2 ranks would split q_proj's 96 rows at 48, inside
    a block. Refused by the shard (so by the plan, the engine and `lorafleet plan`), naming
    the module and the block; per-channel FP8 splits anywhere."""
    model_dir = tmp_path / "fp8"
    quantize_dir(family_model_dir("qwen3"), model_dir, "fp8-block")
    spec = load_model_spec(model_dir)
    with pytest.raises(ModelConfigError, match=r"model\.layers\.0\.self_attn\.q_proj.*128"):
        TPShard(spec, 0, 2)
    with pytest.raises(ModelConfigError, match="q_proj"):
        mp.weight_bytes(spec, 2, torch.bfloat16)
    channel = tmp_path / "channel"
    quantize_dir(family_model_dir("qwen3"), channel, "ct-fp8-channel")
    TPShard(load_model_spec(channel), 1, 2)
    # int4 groups of 32 cannot split down_proj's 96 input columns in two; groups of 16 can
    for fmt, ok in (("ct-w4a16-asym-g32", False), ("ct-w4a16-g16", True)):
        quantize_dir(family_model_dir("qwen3"), tmp_path / fmt, fmt)
        if ok:
            TPShard(load_model_spec(tmp_path / fmt), 0, 2)
            continue
        with pytest.raises(ModelConfigError, match=r"layers\.0\.self_attn\.o_proj.*group"):
            TPShard(load_model_spec(tmp_path / fmt), 0, 2)
    # NF4's absmax blocks run along the flattened rows: rows in whole blocks, no input split
    quantize_dir(family_model_dir("qwen3"), tmp_path / "nf4", "bnb-nf4")
    spec = load_model_spec(tmp_path / "nf4")
    with pytest.raises(ModelConfigError, match=r"q_proj \(bitsandbytes\): its output rows 0:48 "
                                               r"on rank 0 cut its absmax blocks"):  # fmt: skip
        TPShard(spec, 0, 2)
    fmt = spec.quant.format_of("model.layers.0.self_attn.o_proj")
    only_o = dataclasses.replace(spec.quant, groups=(((r"re:.*\.o_proj",), fmt),))
    with pytest.raises(ModelConfigError, match=r"o_proj \(bitsandbytes\): its input columns "
                                               r"cannot be split"):  # fmt: skip
        TPShard(dataclasses.replace(spec, quant=only_o), 0, 2)


REFUSED = {
    "gguf": {"quant_method": "gguf"},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    "eetq": {"quant_method": "eetq"},
    "mxfp4": {"quant_method": "mxfp4"},
}


@pytest.mark.parametrize("method", list(REFUSED))
def test_an_unserved_quant_method_is_refused_in_one_line_naming_it(method):
    cfg = json.loads((family_model_dir("qwen3") / "config.json").read_text())
    cfg["quantization_config"] = REFUSED[method]
    with pytest.raises(ModelConfigError, match=f"quant_method='{method}' is not served") as e:
        spec_from_dict(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4,
                                  "type": "float", "strategy": "tensor_group"}}}},
         "format='nvfp4-pack-quantized' is not served"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8,
                                  "type": "int", "strategy": "channel"}}}},
         "num_bits=8 strategy='channel' are not served"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8 is not served"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"},
         "checkpoint_format='gptq_v2' is not served"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2' is not served"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "load_in_8bit=True"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
         "bnb_4bit_quant_type='fp4' is not served"),
    ],
)  # fmt: skip
def test_an_unserved_variant_of_a_served_method_is_refused_naming_it(quant, named):
    cfg = json.loads((family_model_dir("qwen3") / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=named):
        spec_from_dict(cfg | {"quantization_config": quant})


def test_a_packed_tensor_of_the_wrong_dtype_or_an_unused_one_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from replica.model.weights import WeightLoadError

    model_dir = tmp_path / "gptq"
    quantize_dir(tiny_assets("llama").model_dir, model_dir, "gptq-g32")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.up_proj.scales"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, path)
    with pytest.raises(WeightLoadError, match=f"'{name}' is stored as I32"):
        CausalLM(model_dir)
    quantize_dir(tiny_assets("llama").model_dir, model_dir, "gptq-g32")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.o_proj.qzeros_extra"] = torch.zeros(1)
    save_file(tensors, path)
    with pytest.raises(WeightLoadError, match="o_proj.qzeros_extra"):
        CausalLM(model_dir)


def test_transformers_reads_our_block_fp8_writer_as_we_do(tmp_path):
    """The writer's block-FP8 files mean to transformers what they mean to us: its
    dequantized weights equal kernels.dequantize of what we load (the oracle of the other
    formats is the same function)."""
    src = family_model_dir("qwen3", overrides=BLOCK_QWEN3)
    model_dir = tmp_path / "fp8"
    oracle = quantize_dir(src, model_dir, "fp8-block")
    ref, dense = hf_model(model_dir), hf_model(oracle)
    p = prompts(256)[1]
    assert torch.equal(hf_logits(ref, p), hf_logits(dense, p))
    shutil.rmtree(oracle)


@pytest.mark.parametrize("fmt", ["ct-w4a16-asym-g32", "fp8-block"])
def test_packed_experts_with_expert_lora_match_transformers(tmp_path, fmt):
    """Qwen3-MoE with every expert packed (stacked per layer, kernels.quant_moe_gemm), a
    dense layer between: base, an attention adapter and one on everything including the
    experts' stacked parameters, in one mixed batch."""
    src = family_model_dir("qwen3moe")
    model_dir = tmp_path / fmt
    oracle = quantize_dir(src, model_dir, fmt)
    adapters = family_adapters("qwen3moe", src, tmp_path)
    eng = engine_for(model_dir, adapters, lora_experts=True)
    moe = eng.executor.model.layers[0].mlp
    assert [type(w) for w in moe.packed] == [PACKED[fmt]] * 3
    assert all(w.num_experts == 8 for w in moe.packed)
    check_mixed_batch(eng, oracle, adapters, prompts(eng.spec.vocab_size), NEW_TOKENS)
