"""An adapter that needs an engine setting (expert LoRA: engine.lora_experts; LoRA on the
embedding or head: engine.lora_embeddings) on a server without it: refused where the
cluster reads adapters, the AdapterStore's registration (the 400 of a load) and `lorafleet
up`'s check of the adapters it registers at start, in one line naming the setting; with
the setting, the same adapter passes both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cluster.demo.families import family_model_dir
from cluster.store.conversion import Converter
from replica.model.spec import load_model_spec
from router.errors import BadRequestError
from tests.cluster.cli_runs import refused, run_cli
from tests.oracle import peft_adapter

SETTING = r"engine\.lora_experts: true"


def expert_adapter(model_dir: Path, out: Path) -> Path:
    """A rank-4 PEFT adapter on expert 0's gate_proj of the model's first (sparse) layer,
    in the per-expert layout."""
    spec = load_model_spec(model_dir)
    assert spec.is_sparse(0)
    key = f"base_model.model.model.layers.0.{spec.moe_block}.experts.0.gate_proj"
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    out.mkdir()
    a, b = torch.ones(4, h), torch.ones(inter, 4)
    save_file({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b},
              out / "adapter_model.safetensors")  # fmt: skip
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def test_the_store_refuses_an_expert_adapter_naming_the_setting(tmp_path, monkeypatch):
    from cluster.store import conversion

    model_dir = family_model_dir("qwen3moe")
    adapter = expert_adapter(model_dir, tmp_path / "experts")
    with pytest.raises(BadRequestError, match=SETTING) as refused_load:
        Converter(str(model_dir), max_lora_rank=64).convert("experts", adapter)
    assert "\n" not in str(refused_load.value)
    monkeypatch.setattr(conversion.ray, "put", lambda payload: "in the object store")
    served = Converter(str(model_dir), max_lora_rank=64, lora_experts=True)
    converted = served.convert("experts", adapter)
    assert converted.ranks == {"experts_gate_up": 4}
    assert converted.applied == {"mlp.experts.gate_proj": 1}


def test_up_refuses_an_expert_adapter_at_start_unless_the_setting_is_on(
    tiny, tmp_path, capsys, nothing_starts
):
    model_dir = tmp_path / "qwen3moe"
    shutil.copytree(family_model_dir("qwen3moe"), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.model_dir / name, model_dir / name)
    adapter = expert_adapter(model_dir, tmp_path / "experts")
    argv = ("up", "--model", str(model_dir), "--lora", f"experts={adapter}")
    line = refused(capsys, *argv)
    assert "applications[0].args.store.adapters.experts:" in line
    assert "engine.lora_experts: true" in line
    with pytest.raises(AssertionError, match="went on to start Ray"):  # past the checks
        run_cli(capsys, *argv, "--set", "engine.lora_experts=true", "--no-demo-requests")


def test_up_checks_an_embedding_adapter_with_the_engine_s_lora_embeddings(
    tiny, tmp_path, capsys, nothing_starts
):
    """`up` read its adapters without engine.lora_embeddings, so an adapter with LoRA on
    the embedding was refused at start even with the setting on."""
    adapter = peft_adapter(tiny.model_dir, tmp_path / "vocab", ["embed_tokens", "q_proj"],
                           r=4, alpha=8, seed=3)  # fmt: skip
    capsys.readouterr()  # transformers' loading lines, not the command's
    argv = ("up", "--model", str(tiny.model_dir), "--lora", f"vocab={adapter}")
    assert "engine.lora_embeddings" in refused(capsys, *argv)
    with pytest.raises(AssertionError, match="went on to start Ray"):  # past the checks
        run_cli(capsys, *argv, "--set", "engine.lora_embeddings=true", "--no-demo-requests")
