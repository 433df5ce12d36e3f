"""An adapter's load names every module it changes, as its file names it within a layer
("self_attn.q_proj", "linear_attn.in_proj_qkv"), with its layer count, so a module left
out (a layer without it) or a layer type left out shows in the load's answer and log."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import FAMILY_CONFIGS, family_model_dir
from replica.adapters.packing import pack_adapter, unpack_adapter
from replica.model.adapter_weights import load_peft_adapter
from replica.model.spec import load_model_spec
from replica.wire import applied_text
from tests.conftest import tiny_assets
from tests.oracle import family_adapters, hf_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def test_applied_counts_each_modules_layers_as_the_file_holds_them(tmp_path):
    tiny = tiny_assets("llama")
    spec = load_model_spec(tiny.model_dir)
    adapter = tmp_path / "partial"
    shutil.copytree(tiny.adapters["adapter-00"], adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    layer0 = [k for k in tensors if ".layers.0." in k]
    module = sorted(layer0)[0].split(".")[-3]  # one module of layer 0 goes
    for key in [k for k in layer0 if f".{module}." in k]:
        del tensors[key]
    save_file(tensors, adapter / "adapter_model.safetensors")
    full = load_peft_adapter(tiny.adapters["adapter-00"], spec, 64, "full").applied()
    partial = load_peft_adapter(adapter, spec, 64, "partial").applied()
    block = "self_attn" if module in ATTENTION else "mlp"
    assert set(full) == set(partial) and full[f"{block}.{module}"] == spec.num_layers
    assert partial == {**full, f"{block}.{module}": spec.num_layers - 1}
    assert f"{block}.{module} \u00d7{spec.num_layers - 1}" in applied_text(partial)


def test_a_dense_models_report_names_attention_and_mlp_modules():
    tiny = tiny_assets("llama")
    spec = load_model_spec(tiny.model_dir)
    weights = load_peft_adapter(tiny.adapters["adapter-00"], spec, 64, "a")
    n = spec.num_layers
    want = [f"self_attn.{m}" for m in ATTENTION] + [f"mlp.{m}" for m in MLP]
    assert weights.applied() == {path: n for path in sorted(want)}
    assert applied_text(weights.applied()) == ", ".join(f"{p} \u00d7{n}" for p in sorted(want))
    # what a replica unpacks from the object store (a tensor-parallel shard too) says the same
    assert unpack_adapter(pack_adapter(weights)).applied() == weights.applied()
    assert weights.select(lambda m, a, b, layer: (a, b)).applied() == weights.applied()


def test_the_vocabulary_modules_count_once(tmp_path):
    from tests.oracle import peft_adapter

    model_dir = family_model_dir("qwen3")
    path = peft_adapter(model_dir, tmp_path / "v", ["embed_tokens", "lm_head"], r=4, alpha=4,
                        seed=1)  # fmt: skip
    weights = load_peft_adapter(path, load_model_spec(model_dir), 64, "v", lora_embeddings=True)
    assert weights.applied() == {"embed_tokens": 1, "lm_head": 1}


# A module's path within layer L of transformers' model: its parameter's name less the
# layer's prefix and a trailing .weight / .bias (a stacked experts' parameter keeps its name)
_IN_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+?)(?:\.weight|\.bias)?$")


@pytest.mark.parametrize("family", ["llama", *FAMILY_CONFIGS])
def test_every_familys_report_names_transformers_modules_on_each_layer_having_them(
    family, tmp_path
):
    """The "all" adapter of every family: each name its load reports is a module (or a
    stacked experts' parameter) of transformers' model within a layer, PEFT's own view of
    the checkpoint, and its count the number of language-model layers having it (expert
    LoRA read as engine.lora_experts serves it)."""
    if family == "llama":
        tiny = tiny_assets("llama")
        model_dir, path = tiny.model_dir, tiny.adapters["adapter-00"]
    else:
        model_dir = family_model_dir(family)
        path = family_adapters(family, model_dir, tmp_path)["all"]
    spec = load_model_spec(model_dir)
    applied = load_peft_adapter(path, spec, 64, "all", lora_experts=True).applied()
    layers: dict[str, set[int]] = {}
    for name, _ in hf_model(model_dir).named_parameters():
        m = _IN_LAYER.match(name)
        if m is not None and "vision" not in name and "visual" not in name:
            layers.setdefault(m.group(2), set()).add(int(m.group(1)))
    assert applied == {path: len(layers.get(path, ())) for path in applied}
    assert all(applied.values()), applied


def test_moe_expert_lora_is_named_by_its_experts_block(tmp_path):
    """Per-expert 2D LoRA (Mixtral's w1/w3/w2 under block_sparse_moe) is reported once
    per layer, the expert's index left out."""
    model_dir = family_model_dir("mixtral")
    spec = load_model_spec(model_dir)
    g = torch.Generator().manual_seed(0)
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    tensors = {}
    for layer in range(spec.num_layers):
        for expert in (0, 2):
            for proj, (i, o) in (("w1", (h, inter)), ("w2", (inter, h))):
                key = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{expert}"
                tensors[f"{key}.{proj}.lora_A.weight"] = torch.randn(4, i, generator=g)
                tensors[f"{key}.{proj}.lora_B.weight"] = torch.randn(o, 4, generator=g)
    adapter = tmp_path / "experts"
    adapter.mkdir()
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1", "w2"]}'
    )
    applied = load_peft_adapter(adapter, spec, 64, "experts", lora_experts=True).applied()
    n = spec.num_layers
    assert applied == {"block_sparse_moe.experts.w1": n, "block_sparse_moe.experts.w2": n}
