"""Qwen3.5-MoE against the outside oracle: transformers (eager) + PEFT, fp32.

The tiny model (cluster/demo/families.py "qwen35moe") is Qwen3.5's hybrid layers (see
test_qwen3_5.py) with every MLP sparse: top-2 of 4 experts, renormalised, plus a shared
expert behind its sigmoid gate, in the Hub's multimodal layout with per-expert keys.
Adapters are written by peft: the linear-attention projections only, and the stacked
experts only (target_parameters).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from replica.model.peft_config import AdapterFormatError
from replica.model.spec import load_model_spec, spec_from_dict
from tests.oracle import LINEAR_ATTENTION, check_mixed_batch, hf_model, peft_adapter
from tests.replica.model.families import MARGIN, NEW_TOKENS, engine_for, prompts, router_margin

EXPERTS = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
    model_dir = family_model_dir("qwen35moe")
    root = tmp_path_factory.mktemp("qwen35moe")
    adapters = {
        "linear": peft_adapter(model_dir, root / "linear", LINEAR_ATTENTION, r=8, alpha=16, seed=1),
        "experts": peft_adapter(model_dir, root / "experts", [], r=4, alpha=8, seed=3, **EXPERTS),
    }
    return model_dir, adapters


def test_qwen3_5_moe_matches_transformers_and_peft_in_one_mixed_batch(qwen35moe):
    """The shared expert and its gate, renormalised top-2 routing, Gated DeltaNet and
    gated attention: logits of every position within 2e-4 and greedy tokens of one mixed
    batch with chunked prefill equal transformers + PEFT; each adapter changes the
    continuation. (No expert choice is within MARGIN of flipping.)"""
    model_dir, adapters = qwen35moe
    eng = engine_for(model_dir, adapters, lora_experts=True)
    spec = eng.spec
    assert spec.shared_expert_size == 48 and spec.num_experts == 4 and spec.norm_topk_prob
    ps = prompts(spec.vocab_size)
    for adapter in (None, *adapters.values()):
        ref = hf_model(model_dir, adapter, eager=True)
        for p in ps:
            assert router_margin(ref, p, spec.num_experts_per_tok) > MARGIN, adapter
    got = check_mixed_batch(eng, model_dir, adapters, ps, NEW_TOKENS)
    for name in adapters:
        assert got[name] != got[None], f"{name}: the adapter should change the continuation"


def test_the_shared_expert_bites(qwen35moe):
    """Without the shared expert's gate (sigmoid -> 1) the logits move by far more than
    the oracle's tolerance: the test above checks it."""
    model_dir, _ = qwen35moe
    eng = engine_for(model_dir, {})
    p = prompts(eng.spec.vocab_size)[1]
    want = eng.score(p)
    mlp = eng.executor.model.layers[0].mlp
    gate_up, down, gate = mlp.shared
    mlp.shared = (gate_up, down, torch.full_like(gate, 0.0))  # sigmoid(0) = 1/2
    try:
        assert (eng.score(p) - want).abs().max() > 0.05
    finally:
        mlp.shared = (gate_up, down, gate)
    assert torch.equal(eng.score(p), want)


def test_shared_expert_lora_is_refused_by_name(qwen35moe, tmp_path):
    """LoRA on the shared expert or its gate is not served: refused naming the tensor."""
    from replica.model.adapter_weights import load_peft_adapter

    model_dir, adapters = qwen35moe
    spec = load_model_spec(model_dir)
    for module, out in (("shared_expert.gate_proj", 48), ("shared_expert_gate", 1)):
        bad = tmp_path / module
        shutil.copytree(adapters["linear"], bad)
        tensors = load_file(bad / "adapter_model.safetensors")
        key = f"base_model.model.model.layers.1.mlp.{module}.lora_A.weight"
        tensors[key] = torch.zeros(8, spec.hidden_size)
        tensors[key.replace("lora_A", "lora_B")] = torch.zeros(out, 8)
        save_file(tensors, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterFormatError, match=key.replace(".", r"\.")):
            load_peft_adapter(bad, spec, 64)


def test_config_reads_as_transformers_fills_it_in():
    """Qwen3_5MoeConfig's defaults (the 35B-A3B's shapes): 256 experts of 512, top 8,
    a shared expert of 512, every layer sparse, 3 of every 4 layers linear."""
    from transformers import Qwen3_5MoeConfig

    spec = spec_from_dict(Qwen3_5MoeConfig().to_dict())
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (
        256, 8, 512
    )  # fmt: skip
    assert spec.shared_expert_size == 512 and not spec.dense_layers
    assert len(spec.linear_attention.layers) == 30 and len(spec.kv_layers) == 10
