"""Bad models and adapters fail with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from replica.model.adapter_weights import AdapterFormatError, load_peft_adapter
from replica.model.decoder import CausalLM
from replica.model.spec import ModelConfigError, load_model_spec, spec_from_dict
from replica.model.weights import WeightLoadError
from tests.model_dirs import edit_config, write_gguf_labelled_qwen3


@pytest.fixture
def model_copy(tiny, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny.model_dir, dst)
    return dst


def test_unsupported_architecture_is_named(model_copy):
    edit_config(model_copy, model_type="gpt2")
    with pytest.raises(
        ModelConfigError, match="model_type='gpt2'.*llama, mistral, qwen2, qwen3, gemma2, gemma3"
    ):
        load_model_spec(model_copy)


def test_unsupported_rope_type_is_named(model_copy):
    edit_config(model_copy, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="rope_type='dynamic'"):
        load_model_spec(model_copy)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_spec(tmp_path)


def test_missing_weight_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        WeightLoadError, match="missing weight 'model.layers.1.mlp.down_proj.weight'"
    ):
        CausalLM(model_copy)


def test_an_index_without_a_weight_map_is_named(model_copy):
    """A model.safetensors.index.json that maps no names to files is refused by its path,
    by the loader and, for Gemma 4 MoE, whose spec reads the tensor names, by the spec."""
    from cluster.demo.families import family_model_dir

    gemma = model_copy.with_name("gemma4moe")
    shutil.copytree(family_model_dir("gemma4moe"), gemma)
    for model_dir in (model_copy, gemma):
        (model_dir / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(WeightLoadError, match=r"index.json: no weight_map"):
        CausalLM(model_copy)
    with pytest.raises(WeightLoadError, match=r"index.json: no weight_map"):
        load_model_spec(gemma)


def test_mismatched_shape_is_named(model_copy):
    edit_config(model_copy, intermediate_size=96)
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape"):
        CausalLM(model_copy)


def test_adapter_rank_over_limit(tiny):
    spec = load_model_spec(tiny.model_dir)
    path = tiny.adapters["adapter-01"]  # rank 16
    with pytest.raises(AdapterFormatError, match="rank 16 exceeds max_lora_rank 8"):
        load_peft_adapter(path, spec, max_lora_rank=8)


def test_adapter_for_another_base_model(tiny, demo):
    spec = load_model_spec(demo.model_dir)  # hidden 512: tiny's adapters are hidden 64
    with pytest.raises(
        AdapterFormatError,
        match=r"layer 0 \w+_proj: lora_A \(8, \d+\).*expected.*for this base model",
    ):
        load_peft_adapter(tiny.adapters["adapter-00"], spec, 64)


def test_adapter_missing_files_and_bad_json(tiny, tmp_path):
    spec = load_model_spec(tiny.model_dir)
    with pytest.raises(AdapterFormatError, match="missing adapter_config.json"):
        load_peft_adapter(tmp_path, spec, 64)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError, match="invalid JSON"):
        load_peft_adapter(tmp_path, spec, 64)
    shutil.copy(tiny.adapters["adapter-00"] / "adapter_config.json", tmp_path)
    with pytest.raises(AdapterFormatError, match="missing adapter_model.safetensors"):
        load_peft_adapter(tmp_path, spec, 64)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterFormatError, match="unreadable safetensors"):
        load_peft_adapter(tmp_path, spec, 64)


def test_adapter_unsupported_features(tiny, tmp_path):
    spec = load_model_spec(tiny.model_dir)
    dst = tmp_path / "a"
    shutil.copytree(tiny.adapters["adapter-00"], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterFormatError, match="DoRA is not supported"):
        load_peft_adapter(dst, spec, 64)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_magnitude_vector"] = tensors[next(iter(tensors))].clone()
    save_file(tensors, dst / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="unsupported tensor 'base_model.model.lm_head"):
        load_peft_adapter(dst, spec, 64)


def test_an_unknown_checkpoint_tensor_is_refused_by_name(model_copy):
    """A tensor the decoder neither reads nor knowingly skips (a module this server does
    not implement) stops the load, named, instead of being served without it."""
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="'model.layers.0.mlp.extra_proj.weight' is not used"):
        CausalLM(model_copy)


def test_known_unread_tensors_still_load(model_copy):
    """Rotary frequencies (recomputed from config.json) and, on a tied model, an lm_head
    copy of the embedding are skipped knowingly: the model loads and equals the original."""
    before = CausalLM(model_copy)
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path, metadata={"format": "pt"})
    after = CausalLM(model_copy)
    assert all(torch.equal(a, b) for a, b in zip(before.step_weights(), after.step_weights()))
    if not after.spec.tie_word_embeddings:  # an untied lm_head is read, never skipped
        return
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    CausalLM(model_copy)


def test_a_multimodal_gemma3_skips_its_vision_tower_knowingly_and_nothing_else():
    """Gemma 3's multimodal checkpoint holds a vision tower and projector this text server
    does not read: allowed by name for model_type gemma3 only."""
    from cluster.demo.families import family_model_dir
    from replica.model.weights import Checkpoint

    model_dir = family_model_dir("gemma3-mm")
    assert any(n.startswith("vision_tower.") for n in Checkpoint(model_dir).names())
    CausalLM(model_dir)  # loads
    # the same tensors under the text-only family are unknown
    text_only = replace(load_model_spec(model_dir), arch="gemma3_text")
    with pytest.raises(WeightLoadError, match="'multi_modal_projector.mm_input_projection"):
        CausalLM(model_dir, spec=text_only)


def test_a_float8_weight_without_a_quantization_config_is_refused_by_name(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=f"'{name}' is stored as F8_E4M3"):
        CausalLM(model_copy)


def test_an_unserved_quant_method_is_refused_by_the_spec_the_model_and_the_engine(tmp_path):
    from replica.config import EngineConfig
    from replica.engine.engine import LLMEngine

    model_dir = tmp_path / "qwen3-gguf"
    write_gguf_labelled_qwen3(model_dir)
    refusal = "quantization_config with quant_method='gguf' is not served"
    with pytest.raises(ModelConfigError, match=refusal):
        load_model_spec(model_dir)
    with pytest.raises(ModelConfigError, match=refusal):
        CausalLM(model_dir)
    with pytest.raises(ModelConfigError, match=refusal):
        LLMEngine(EngineConfig(model=str(model_dir), device="cpu", adapters={"num_slots": 2}))
    # a multimodal checkpoint may declare it in its text_config
    eetq = {"quantization_config": {"quant_method": "eetq"}}
    with pytest.raises(ModelConfigError, match="quant_method='eetq'"):
        spec_from_dict({"model_type": "gemma3", "text_config": eetq})


def test_float8_weights_whose_config_is_stripped_are_refused_by_name(tmp_path):
    """A block-FP8 checkpoint whose quantization_config was lost: its float8 codes are not
    read as weights without their scales."""
    from cluster.demo.families import family_model_dir
    from tests.quant_checkpoints import quantize_dir

    model_dir = tmp_path / "qwen3-fp8"
    quantize_dir(family_model_dir("qwen3"), model_dir, "fp8-block")
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.self_attn.q_proj.weight' is "
                                              r"stored as F8_E4M3"):  # fmt: skip
        CausalLM(model_dir)


def test_a_scale_tensor_beside_plain_weights_is_refused_by_name(tmp_path):
    """A weight_scale_inv left in an otherwise plain checkpoint is a tensor the loader
    does not use: named, not skipped."""
    from cluster.demo.families import family_model_dir

    model_dir = tmp_path / "qwen3"
    shutil.copytree(family_model_dir("qwen3"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="'model.layers.1.mlp.down_proj.weight_scale_inv'"):
        CausalLM(model_dir)
