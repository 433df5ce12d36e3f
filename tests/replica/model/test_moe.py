"""Mixtures of experts against the outside oracle: transformers (eager) + PEFT, fp32.

Mixtral (every layer sparse, renormalised top-2 of 4) and Qwen3-MoE (top-2 of 8 without
renormalising, q/k norms, layer 1 dense through mlp_only_layers), tiny random-weight
models from cluster/demo/families.py in the Hub's per-expert layout. Their routers are
drawn large, and every test prompt's top-k margin is checked, so fp32 rounding never flips
an expert choice between us and transformers.

Adapters: attention-only and PEFT target_parameters (3D, experts' gate_up and down, with a
rank_pattern) written by peft itself, checked against PEFT in one mixed batch with chunked
prefill; per-expert 2D adapters (what transformers-4 PEFT writes; transformers 5 cannot
load them) checked against the base with each expert's delta merged into its weights.
Expert LoRA is served with engine.lora_experts; by default a replica has no expert arenas,
serves attention adapters alike and refuses expert ones at load.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from replica.model.adapter_weights import load_peft_adapter
from replica.model.peft_config import AdapterFormatError
from replica.model.spec import load_model_spec
from tests.oracle import check_mixed_batch, family_adapters, hf_greedy, hf_logits, hf_model
from tests.replica.model.families import (
    GREEDY,
    MARGIN,
    NEW_TOKENS,
    engine_for,
    prompts,
    router_margin,
    traced_static_decode,
)

MOE = ["mixtral", "qwen3moe"]


@pytest.fixture(scope="module")
def adapters_of(tmp_path_factory):
    """family -> (model dir, its two peft adapters), each built once for the module."""
    built: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(name: str) -> tuple[Path, dict[str, Path]]:
        if name not in built:
            model_dir = family_model_dir(name)
            root = tmp_path_factory.mktemp(name)
            built[name] = model_dir, family_adapters(name, model_dir, root)
        return built[name]

    return get


@pytest.fixture(params=MOE)
def moe(request, adapters_of):
    return request.param, *adapters_of(request.param)


@pytest.mark.slow
def test_moe_base_and_adapters_match_transformers_and_peft_in_one_mixed_batch(moe):
    name, model_dir, adapters = moe
    spec = load_model_spec(model_dir)
    ps = prompts(spec.vocab_size)
    for adapter in (None, *adapters.values()):
        ref = hf_model(model_dir, adapter, eager=True)
        for p in ps:
            assert router_margin(ref, p, spec.num_experts_per_tok) > MARGIN, (name, adapter)
    eng = engine_for(model_dir, adapters, lora_experts=True)
    got = check_mixed_batch(eng, model_dir, adapters, ps, NEW_TOKENS)
    assert got[None] != got["all"], f"{name}: the expert adapter should change the continuation"


def test_an_attention_adapter_on_an_moe_base_matches_peft_without_expert_arenas(moe):
    """By default (engine.lora_experts off) the arenas hold no expert rows, and an adapter
    on attention alone serves as transformers + PEFT computes it, beside the base."""
    from replica.adapters.memory import slot_bytes

    name, model_dir, adapters = moe
    spec = load_model_spec(model_dir)
    attn = {"attn": adapters["attn"]}
    eng = engine_for(model_dir, attn)
    lora = eng.executor.lora
    assert not any(g.startswith("experts") for g in lora.groups)
    assert all(not g.startswith("experts") for layer in lora.layers for g in layer)
    assert lora.nbytes() == slot_bytes(spec, lora.num_rows, torch.float32)
    assert lora.nbytes() < slot_bytes(spec, lora.num_rows, torch.float32, experts=True)
    got = check_mixed_batch(eng, model_dir, attn, prompts(spec.vocab_size)[:1], 4)
    assert got[None] != got["attn"], f"{name}: the adapter should change the continuation"


def test_an_expert_adapter_is_refused_at_load_naming_the_setting(moe, tmp_path):
    """Either layout (PEFT target_parameters, per-expert keys) on an engine without
    engine.lora_experts: refused in one line naming it, nothing registered; the slot
    buffers refuse to write one too."""
    from replica.model.lora_slots import LoRASlotBuffers

    name, model_dir, adapters = moe
    eng = engine_for(model_dir, {"attn": adapters["attn"]})
    per_expert = per_expert_adapter(model_dir, tmp_path / "2d", seed=5)
    for adapter, path in (("all", adapters["all"]), ("2d", per_expert)):
        with pytest.raises(AdapterFormatError, match=r"engine\.lora_experts: true") as refused:
            eng.load_adapter(adapter, path)
        assert "\n" not in str(refused.value) and "experts" in str(refused.value)
        assert adapter not in eng.known_adapters()
    spec = load_model_spec(model_dir)
    weights = load_peft_adapter(adapters["all"], spec, 64, lora_experts=True)
    bufs = LoRASlotBuffers(spec, 2, 16, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="needs engine.lora_experts"):
        bufs.write(0, weights)


def per_expert_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A 2D per-expert adapter (the family's expert names and block) on every sparse
    layer's experts 0..2 (the rest untouched): rsLoRA, rank 8 with one expert at rank 4
    and its own alpha through rank_pattern / alpha_pattern."""
    spec = load_model_spec(model_dir)
    g = torch.Generator().manual_seed(seed)
    block = spec.moe_block
    tensors = {}
    for layer in range(spec.num_layers):
        if not spec.is_sparse(layer):
            continue
        for e in range(3):
            r = 4 if (layer, e) == (0, 1) else 8
            for proj, (i, o) in zip(spec.expert_names, spec.expert_shapes().values()):
                key = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=g) / math.sqrt(i)
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g) / math.sqrt(r)
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    pattern = f"layers.0.{block}.experts.1.{spec.expert_names[0]}"
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True,
              "target_modules": list(spec.expert_names),
              "rank_pattern": {f"layers.0.{block}.experts.1.*": 4},
              "alpha_pattern": {pattern: 6}}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_base(model_dir: Path, adapter: Path, out: Path) -> Path:
    """The base with each expert's scaling · B·A added to its weights (PEFT's rules for
    rsLoRA and the patterns, read back from the adapter's config)."""
    from replica.model.peft_config import pattern_key

    config = json.loads((adapter / "adapter_config.json").read_text())
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, a in lora.items():
        if not key.endswith("lora_A.weight"):
            continue
        b = lora[key.replace("lora_A", "lora_B")]
        path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        r = config["rank_pattern"].get(pattern_key(config["rank_pattern"], path), config["r"])
        alpha = config["alpha_pattern"].get(pattern_key(config["alpha_pattern"], path),
                                            config["lora_alpha"])  # fmt: skip
        assert a.shape[0] == r
        weights[path + ".weight"] += alpha / math.sqrt(r) * (b @ a)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family", MOE)
def test_per_expert_2d_adapter_equals_the_merged_base(family, tmp_path):
    model_dir = family_model_dir(family)
    adapter = per_expert_adapter(model_dir, tmp_path / "2d", seed=5)
    ref = hf_model(merged_base(model_dir, adapter, tmp_path / "merged"), eager=True)
    eng = engine_for(model_dir, {"2d": adapter}, lora_experts=True)
    ps = prompts(eng.spec.vocab_size)
    for p in ps:
        assert router_margin(ref, p, eng.spec.num_experts_per_tok) > MARGIN
        diff = (eng.score(p, "2d") - hf_logits(ref, p)).abs().max().item()
        assert diff < 2e-4, f"{family}: max |logit diff| {diff}"
    outputs = eng.generate([(p, GREEDY, a) for p in ps for a in ("2d", None)])
    base = hf_model(model_dir, eager=True)
    want = [hf_greedy(m, p, NEW_TOKENS) for p in ps for m in (ref, base)]
    assert [s.output_ids for s in outputs] == want
    assert want[0] != want[1], "the adapter should change the continuation"


def test_expert_adapter_weights_are_counted_at_their_real_size(moe):
    """An expert adapter holds E x (gate, up, down) x r rows per sparse layer: its
    converted bytes and the arena bytes one rank row costs."""
    from replica.adapters.memory import slot_bytes
    from replica.model.lora_slots import LoRASlotBuffers

    name, model_dir, adapters = moe
    spec = load_model_spec(model_dir)
    w = load_peft_adapter(adapters["all"], spec, 64, lora_experts=True)
    experts = sum(a.nbytes + b.nbytes for (_, m), (a, b) in w.weights.items()
                  if m.startswith("expert_"))  # fmt: skip
    # the file's 3D pairs at their own ranks (PEFT gives gate_up 2r on Qwen3-MoE, our
    # rank_pattern layer 0's down 4): lora_A [E·r, in] (kept once for gate and once for
    # up), lora_B [out, E·r]
    want, file = 0, load_file(adapters["all"] / "adapter_model.safetensors")
    for key, a in file.items():
        if ".experts." in key and "lora_A" in key:
            gate_up = a.shape[1] == spec.hidden_size  # down's A reads the intermediate
            want += ((2 if gate_up else 1) * a.numel() + file[key.replace("_A", "_B")].numel()) * 4
    assert experts == want
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32, experts=True)
    assert bufs.nbytes() == slot_bytes(spec, bufs.num_rows, torch.float32, experts=True)
    # through the object store's numpy payload, a TP rank's shard of the experts: the same
    from replica.adapters.packing import pack_adapter, unpack_adapter
    from replica.model.tp_shard import TPShard

    shard = TPShard(spec, 1, 2)
    got = unpack_adapter(pack_adapter(w), select=shard.slice_lora).weights
    want = w.select(shard.slice_lora).weights
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1])
               for k in want)  # fmt: skip
    a, b = want[(0, "expert_down_proj")]  # down: A by the rank's intermediate columns
    assert a.shape[2] == spec.moe_intermediate_size // 2 and b.shape[1] == spec.hidden_size // 2


def test_unreadable_expert_layouts_are_refused_saying_what_was_found(tmp_path):
    model_dir = family_model_dir("qwen3moe")
    spec = load_model_spec(model_dir)
    from replica.model.adapter_weights import convert_peft_tensors

    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    cases = {
        # a fused 2D gate_up per expert: neither layout
        "model.layers.0.mlp.experts.gate_up.0.lora_A.weight": "layout this server cannot read",
        # a 3D pair of neither the gate_up nor the down shapes
        "model.layers.0.mlp.experts.lora_A.weight": "fit neither",
        # per-expert keys on the dense layer 1
        "model.layers.1.mlp.experts.0.gate_proj.lora_A.weight": "a dense layer",
    }
    for key, match in cases.items():
        a = torch.zeros(8 * 4, 10) if "experts.lora" in key else torch.zeros(4, 64)
        b = torch.zeros(64, 8 * 4) if "experts.lora" in key else torch.zeros(32, 4)
        tensors = {f"base_model.model.{key}": a,
                   f"base_model.model.{key.replace('lora_A', 'lora_B')}": b}  # fmt: skip
        with pytest.raises(AdapterFormatError, match=match):
            convert_peft_tensors("x", config, tensors, spec, 64, lora_experts=True)
    dense = load_model_spec(family_model_dir("qwen3"))
    with pytest.raises(AdapterFormatError, match="has no experts"):  # not: turn experts on
        convert_peft_tensors("x", config, tensors, dense, 64)


@pytest.mark.slow
def test_prefix_cache_and_static_decode_with_an_moe_base(adapters_of):
    """Prefix-cache hits and the fixed-shape decode step (no device read) give the eager,
    uncached tokens on Qwen3-MoE with an expert adapter."""
    model_dir, adapters = adapters_of("qwen3moe")
    ps = prompts(256)
    requests = [(p, GREEDY, a) for p in ps for a in (None, *adapters)]
    want = [
        s.output_ids for s in engine_for(model_dir, adapters, lora_experts=True).generate(requests)
    ]

    cached = engine_for(model_dir, adapters, enable_prefix_caching=True, lora_experts=True)
    cached.generate(requests)
    again = cached.generate(requests)
    assert [s.output_ids for s in again] == want
    assert all(s.num_cached_tokens > 0 for s, (p, _, _) in zip(again, requests) if len(p) > 8)

    eng = engine_for(model_dir, adapters, lora_experts=True)
    used, reads = traced_static_decode(eng.executor, 8)  # buckets up to the 6 sequences
    assert [s.output_ids for s in eng.generate(requests)] == want
    assert used and not reads, reads[:3]


# config.json as the Hub ships them (abridged to the fields the spec reads)
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "rope_theta": 1e6, "sliding_window": None}  # fmt: skip
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "use_sliding_window": False,
                 "sliding_window": None, "rope_theta": 1e6}  # fmt: skip


def test_hub_moe_configs_read_as_transformers_fills_them_in():
    from replica.model.spec import ModelConfigError, spec_from_dict

    m = spec_from_dict(MIXTRAL_8X7B)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, 14336)
    assert m.norm_topk_prob and m.moe_block == "block_sparse_moe" and m.expert_names[0] == "w1"
    assert all(m.is_sparse(i) for i in range(32)) and m.window(0) is None
    q = spec_from_dict(QWEN3_30B_A3B)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 8, 768)
    assert q.norm_topk_prob and q.qk_norm and q.dense_layers == ()
    # about 30.5B parameters, as the model card says
    assert 30.0e9 < q.num_parameters() < 31.0e9, q.num_parameters()
    step = spec_from_dict({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert step.dense_layers == tuple(sorted({*range(0, 48, 2), 5}))
    assert spec_from_dict({**QWEN3_30B_A3B, "norm_topk_prob": None}).norm_topk_prob is False
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=9"):
        spec_from_dict({**MIXTRAL_8X7B, "num_experts_per_tok": 9})
