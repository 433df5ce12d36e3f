"""Gemma 4's text model against the outside oracle: transformers (eager) + PEFT, fp32.

The tiny model (cluster/demo/families.py "gemma4", and "gemma4-mm" in
Gemma4ForConditionalGeneration's layout with a vision tower) has every quirk biting:
sliding layers (window 8 < the 40-token prompt, head_dim 16, 2 KV heads, rope base 100)
and full layers (head_dim 32, 1 KV head, values from k_proj, proportional rope over a
quarter of the frequency pairs) alternate; layers 4 and 5 read layers 2's and 3's KV and
have a double-wide MLP; per-layer inputs of width 8; perturbed norms and layer scalars;
a final soft-cap of 15. Prompts of 5 and 40 tokens prefill in 16-token chunks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from replica.config import EngineConfig
from replica.executor.memory_plan import kv_block_bytes
from replica.model.adapter_weights import load_peft_adapter
from replica.model.kv_cache import KVCache
from replica.model.lora import LoRALinear
from replica.model.spec import ModelConfigError, load_model_spec, spec_from_dict
from replica.model.weights import WeightLoadError
from tests.oracle import (
    GEMMA4_EXPERTS,
    check_mixed_batch,
    family_adapters,
    hf_greedy,
    hf_logits,
    hf_model,
    peft_adapter,
)
from tests.replica.model.families import (
    GREEDY,
    LOGIT_ATOL,
    MARGIN,
    NEW_TOKENS,
    check_base_unchanged_beside_adapters,
    engine_for,
    prompts,
    traced_static_decode,
)


@pytest.fixture(scope="module", params=["gemma4", "gemma4-mm"])
def gemma4(request, tmp_path_factory):
    """(family, model dir, {"attn", "all": peft adapter}) built once per layout."""
    model_dir = family_model_dir(request.param)
    root = tmp_path_factory.mktemp(request.param)
    return request.param, model_dir, family_adapters(request.param, model_dir, root)


def test_gemma4_matches_transformers_and_peft_in_one_mixed_batch(gemma4):
    """Every position's logits within 2e-4 and greedy tokens of one mixed batch (base and
    two adapters, chunked prefill) equal transformers + PEFT, in both layouts."""
    name, model_dir, adapters = gemma4
    eng = engine_for(model_dir, adapters)
    spec = eng.spec
    assert spec.window(0) == 8 < len(prompts(256)[1]) and spec.window(1) is None
    assert spec.kv_sources == (0, 1, 2, 3, 2, 3) and spec.layer_head_dims[:2] == (16, 32)
    got = check_mixed_batch(eng, model_dir, adapters, prompts(spec.vocab_size), NEW_TOKENS)
    assert got[None] != got["all"] and got[None] != got["attn"], name


def test_vision_tower_lora_is_skipped_and_the_rest_applied(gemma4, tmp_path):
    """The multimodal "all" adapter also holds LoRA on the vision tower (images are not
    served: skipped, as for Gemma 3); every text module is applied on each layer that has
    it: k_proj on the 4 layers keeping KV, v_proj on the 2 sliding ones of them (full
    layers take values from k_proj), the rest (the per-layer-input projections too) on
    all 6."""
    name, model_dir, adapters = gemma4
    tensors = load_file(adapters["all"] / "adapter_model.safetensors")
    assert any("vision_tower" in k for k in tensors) == (name == "gemma4-mm")
    spec = load_model_spec(model_dir)
    applied = load_peft_adapter(adapters["all"], spec, 64, "all").applied()
    six = {m: 6 for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                          "mlp.up_proj", "mlp.down_proj", "per_layer_input_gate",
                          "per_layer_projection")}  # fmt: skip
    assert applied == {**six, "self_attn.k_proj": 4, "self_attn.v_proj": 2}


def test_each_quirk_bites():
    """Serving without any one of the per-layer inputs, the layer scalars, the value norm,
    values from k_proj, the shared KV, the proportional rope or the final soft-cap
    changes the logits by far more than the oracle's tolerance: the oracle test above
    checks each of them."""
    from dataclasses import replace

    eng = engine_for(family_model_dir("gemma4"), {})
    p = prompts(eng.spec.vocab_size)[1]
    want = eng.score(p)
    model = eng.executor.model
    plain = model._rope(model.spec.local_rope, model.layers[1].spec)  # default rope
    changes = {
        "per-layer inputs": lambda layer: setattr(layer, "per_layer_input", None),
        "layer scalar": lambda layer: setattr(layer, "scalar", None),
        "v_norm": lambda layer: setattr(layer, "v_norm", False),
        "k_eq_v": _values_from_zero_rows,
        "shared KV": _own_kv_from_zero_rows,
        "proportional rope": lambda layer: setattr(layer, "rope", plain)
        if layer.spec.head_dim == 32 else None,
    }  # fmt: skip
    ropes = model.ropes
    for quirk, change in changes.items():
        saved = [dict(vars(layer)) for layer in model.layers]
        for layer in model.layers:
            change(layer)
        model.ropes = [*ropes, plain] if quirk == "proportional rope" else ropes
        assert (eng.score(p) - want).abs().max() > 0.05, quirk
        for layer, attrs in zip(model.layers, saved):
            vars(layer).clear()
            vars(layer).update(attrs)
        model.ropes = ropes
        assert torch.equal(eng.score(p), want), quirk
    spec = model.spec
    model.spec = replace(spec, final_soft_cap=None)
    assert (eng.score(p) - want).abs().max() > 0.05, "final soft-cap"
    model.spec = spec


def _zero_rows(layer, kv_projections: int) -> None:
    """Append rows of zeros for `kv_projections` k/v projections to `layer`'s qkv weight."""
    w = layer.qkv_proj.weight
    zeros = w.new_zeros(kv_projections * layer.spec.kv_size, w.shape[1])
    layer.qkv_proj = LoRALinear(torch.cat([w, zeros]), None, layer.qkv_proj.lora)


def _values_from_zero_rows(layer) -> None:
    """A full layer without v_proj made to read its values from rows of zeros, not from
    k_proj's rows."""
    if layer.k_eq_v:
        _zero_rows(layer, 1)
        layer.k_eq_v = False


def _own_kv_from_zero_rows(layer) -> None:
    """A KV-sharing layer made to write keys and values of its own (zeros) over its source
    layer's, not to read the source's."""
    if not layer.owns_kv:
        _zero_rows(layer, 2)
        layer.owns_kv = True


def test_kv_sharing_layers_hold_no_kv_of_their_own():
    """Layers 4 and 5 read layers 2's and 3's pools: the cache holds 4 pairs of pools, each
    layer's own shape, and the memory plan's block bytes count only those."""
    spec = load_model_spec(family_model_dir("gemma4"))
    cache = KVCache(spec, 3, 4, torch.device("cpu"), torch.float32)
    assert len(cache.pools) == 2 * 4
    assert cache.k[4] is cache.k[2] and cache.v[5] is cache.v[3]
    assert [tuple(cache.k[i].shape) for i in range(4)] == [(2, 12, 16), (1, 12, 32)] * 2
    per_token = 2 * (2 * 16 + 1 * 32)  # two sliding and two full layers own KV
    assert kv_block_bytes(spec, 1, 4, torch.float32) == 2 * 4 * per_token * 4
    unshared = spec_from_dict({**_text_config(), "num_kv_shared_layers": 0})
    assert kv_block_bytes(unshared, 1, 4, torch.float32) == 2 * 4 * (3 * 64) * 4


def test_an_adapter_on_one_module_kind_changes_the_output_as_peft(tmp_path):
    """k_proj alone: on the full layers it changes the values too (they are its output)."""
    model_dir = family_model_dir("gemma4")
    path = peft_adapter(model_dir, tmp_path / "k", ["k_proj"], r=4, alpha=8, seed=5)
    eng = engine_for(model_dir, {"k": path})
    ref = hf_model(model_dir, path, eager=True)
    p = prompts(eng.spec.vocab_size)[1]
    got = eng.score(p, "k")
    assert (got - hf_logits(ref, p)).abs().max().item() < LOGIT_ATOL
    assert (got - eng.score(p)).abs().max().item() > 0.05


def test_base_requests_are_unchanged_by_sixteen_adapters_beside_them(tmp_path):
    model_dir = family_model_dir("gemma4")
    adapters = family_adapters("gemma4", model_dir, tmp_path)
    check_base_unchanged_beside_adapters(model_dir, adapters)


def _text_config() -> dict:
    """A Hub-style Gemma 4 text config: global_head_dim and num_global_key_value_heads
    at the top level, no per_layer_config (what transformers' own save writes instead)."""
    return {
        "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "num_kv_shared_layers": 2, "vocab_size": 256,
        "layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": 8,
    }  # fmt: skip


def test_hub_config_reads_as_transformers_fills_it_in():
    """The saved per_layer_config and the Hub's global_head_dim spelling read alike, as
    transformers' Gemma4TextConfig reads them; its defaults fill what a config leaves out."""
    from transformers import Gemma4TextConfig

    cfg = _text_config()
    ours = spec_from_dict(cfg)
    saved = spec_from_dict({**Gemma4TextConfig(**cfg).to_dict(), "model_type": "gemma4_text"})
    assert ours == saved
    assert ours.layer_head_dims == (16, 32) * 3 and ours.layer_kv_heads == (2, 1) * 3
    assert ours.kv_sources == (0, 1, 2, 3, 2, 3) and ours.kv_layers == (0, 1, 2, 3)
    assert ours.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert ours.rope_theta == 1e6 and ours.local_rope.theta == 10_000.0
    assert ours.per_layer_input_size == 256 and ours.attn_scale == 1.0
    hf = Gemma4TextConfig(**cfg)
    assert ours.per_layer_vocab_size == hf.vocab_size_per_layer_input
    assert ours.max_position_embeddings == hf.max_position_embeddings
    wide = spec_from_dict({**cfg, "use_double_wide_mlp": True})
    assert wide.layer_intermediate_sizes == (96,) * 4 + (192,) * 2


def test_configs_we_cannot_serve_are_refused_by_name():
    cfg = _text_config()
    refused = {
        "enable_moe_block": {"enable_moe_block": True},
        "use_bidirectional_attention='all'": {"use_bidirectional_attention": "all"},
        "attention_bias": {"attention_bias": True},
        "num_kv_shared_layers=6": {"num_kv_shared_layers": 6},
        "vocab_size_per_layer_input=8 is smaller": {"vocab_size_per_layer_input": 8},
        "per_layer_config\\[1\\] sets \\['sliding_window'\\]": {
            "per_layer_config": {"1": {"sliding_window": 4}}
        },
    }
    for message, change in refused.items():
        with pytest.raises(ModelConfigError, match=message):
            spec_from_dict({**cfg, **change})
    vision = spec_from_dict({**cfg, "use_bidirectional_attention": "vision"})
    assert vision.kv_sources  # text-only prompts are causal under "vision": served


def test_prefix_cache_hits_give_the_uncached_output(tmp_path):
    """A prompt extending an earlier one starts after its cached blocks, which the
    sliding, full and KV-sharing layers all read: it equals transformers' output for the
    whole prompt, base and adapter."""
    model_dir = family_model_dir("gemma4")
    adapters = family_adapters("gemma4", model_dir, tmp_path)
    eng = engine_for(model_dir, adapters, enable_prefix_caching=True)
    refs = {
        None: hf_model(model_dir, eager=True),
        "all": hf_model(model_dir, adapters["all"], True),
    }
    first = prompts(eng.spec.vocab_size)[1]  # 40 tokens: ten 4-token blocks
    for adapter, ref in refs.items():
        eng.generate([(first, GREEDY, adapter)])
        longer = first + [5, 6, 7, 8, 9, 10]
        (seq,) = eng.generate([(longer, GREEDY, adapter)])
        assert seq.num_cached_tokens >= 36, (adapter, seq.num_cached_tokens)
        assert seq.output_ids == hf_greedy(ref, longer, NEW_TOKENS), adapter


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4", "gemma4moe"])
def test_static_decode_path_equals_eager(family, tmp_path):
    """The fixed-shape decode step that CUDA graphs replay (its padded rows write a scratch
    block, which the KV-sharing layers read back as they read real rows; the MoE block's
    routing stays on the device): the eager engine's tokens, and no device value read
    inside the step."""
    model_dir = family_model_dir(family)
    adapters = family_adapters(family, model_dir, tmp_path)
    requests = [(p, GREEDY, a) for p in prompts(256) for a in (None, *adapters)]
    experts = family == "gemma4moe"  # its "all" adapter is on the experts too
    want = [
        s.output_ids
        for s in engine_for(model_dir, adapters, lora_experts=experts).generate(requests)
    ]
    eng = engine_for(model_dir, adapters, lora_experts=experts)
    used, reads = traced_static_decode(eng.executor, eng.config.max_num_seqs)
    assert [s.output_ids for s in eng.generate(requests)] == want
    assert used, "no step took the static decode path"
    assert not reads, f"the static step read device values: {reads[:3]}"


def test_plan_counts_only_the_kv_the_layers_own(capsys, tmp_path):
    """`lorafleet plan` on Gemma 4: a KV block holds the 4 owning layers' K and V, each of
    its own shape (2 x 16 or 1 x 32 per token), not 6 layers' of the widest."""
    from tests.cluster.cli_runs import run_cli
    from tests.model_dirs import config_only

    def plan(model) -> dict:
        code, out, err = run_cli(capsys, "plan", "--model", str(model), "--gpu-memory", "1GiB",
                                 "--json")  # fmt: skip
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1])

    model = family_model_dir("gemma4")
    shared = plan(model)
    unshared = plan(config_only(model, tmp_path / "unshared", num_kv_shared_layers=0))
    block = shared["block_size"]
    assert shared["kv_block_bytes"] == 2 * block * (2 * 16 + 1 * 32) * 2 * 2  # bf16
    assert unshared["kv_block_bytes"] == 2 * block * (3 * 16 * 2 + 3 * 32) * 2
    assert shared["kv_cache_tokens"] > unshared["kv_cache_tokens"]


def test_moe_block_matches_transformers_and_peft_in_one_mixed_batch(tmp_path):
    """enable_moe_block: top-2 of 4 experts beside every layer's dense MLP, routed from the
    residual stream (its own norm, scale and per-expert scales). The base, an adapter on
    attention, one on the experts only (PEFT target_parameters) and one on everything:
    logits within 2e-4 and one mixed batch's greedy tokens equal transformers + PEFT, and
    the experts-only adapter is applied on every layer and changes the continuation."""
    model_dir = family_model_dir("gemma4moe")
    adapters = family_adapters("gemma4moe", model_dir, tmp_path)
    adapters["experts"] = peft_adapter(
        model_dir, tmp_path / "experts", [], r=4, alpha=8, seed=3, **GEMMA4_EXPERTS
    )
    spec = load_model_spec(model_dir)
    assert spec.moe_beside_mlp and spec.num_experts == 4 and spec.is_sparse(5)
    weights = load_peft_adapter(adapters["experts"], spec, 64, "experts", lora_experts=True)
    assert weights.applied() == {"experts.gate_up_proj": 6, "experts.down_proj": 6}
    for adapter in (None, *adapters.values()):  # no expert choice within rounding
        ref = hf_model(model_dir, adapter, eager=True)
        assert all(_router_margin(ref, p) > MARGIN for p in prompts(256)), adapter
    eng = engine_for(model_dir, adapters, lora_experts=True)
    got = check_mixed_batch(eng, model_dir, adapters, prompts(spec.vocab_size), NEW_TOKENS)
    assert got["experts"] != got[None] and got["all"] != got[None]


def _router_margin(model, prompt: list[int]) -> float:
    """The smallest gap between the 2nd and 3rd router logit of any token and layer."""
    gaps = []

    def hook(_module, _args, out):
        logits = out.float().sort(dim=-1, descending=True).values
        gaps.append((logits[:, 1] - logits[:, 2]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith("router.proj")]  # fmt: skip
    try:
        hf_logits(model, prompt)
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


@pytest.mark.parametrize("target", ["per_layer_model_projection", "router.proj"])
def test_lora_on_modules_not_served_is_refused_by_name(target, tmp_path):
    """The per-layer inputs' model-level projection and the router take no LoRA here: an
    adapter on one is refused naming its tensor, never loaded without it."""
    from replica.model.peft_config import AdapterFormatError

    model_dir = family_model_dir("gemma4moe")
    path = peft_adapter(model_dir, tmp_path / "a", [target], r=4, alpha=8, seed=4)
    with pytest.raises(AdapterFormatError, match=target.replace(".", "\\.")):
        load_peft_adapter(path, load_model_spec(model_dir), 64, "a")


def test_per_layer_input_lora_equals_peft_in_one_mixed_batch(tmp_path):
    """LoRA on each layer's per_layer_input_gate and per_layer_projection (and, in
    another adapter, on every linear module of the layers besides): applied on all 6
    layers, equal to transformers + PEFT beside the base in one mixed batch, and moving
    the logits."""
    model_dir = family_model_dir("gemma4")
    ple = ["per_layer_input_gate", "per_layer_projection"]
    everything = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj", *ple]  # fmt: skip
    adapters = {
        "ple": peft_adapter(model_dir, tmp_path / "ple", ple, r=4, alpha=8, seed=6),
        "every": peft_adapter(model_dir, tmp_path / "every", everything, r=8, alpha=8, seed=7),
    }
    spec = load_model_spec(model_dir)
    applied = load_peft_adapter(adapters["ple"], spec, 64, "ple").applied()
    assert applied == {m: 6 for m in ple}
    eng = engine_for(model_dir, adapters)
    got = check_mixed_batch(eng, model_dir, adapters, prompts(spec.vocab_size), NEW_TOKENS)
    assert got["every"] != got[None]
    p = prompts(spec.vocab_size)[1]
    assert (eng.score(p, "ple") - eng.score(p)).abs().max() > 0.05


def test_step_memory_is_planned_for_the_widest_layer():
    """The plan's working memory of a step takes each of head_dim (the full layers' 32),
    KV heads (the sliding layers' 2) and MLP width (the sharing layers' 192) at its
    largest: more than the sliding layers' shapes alone would give."""
    from dataclasses import replace

    from replica.executor.memory_plan import step_bytes, widest_layer

    spec = load_model_spec(family_model_dir("gemma4"))
    wide = widest_layer(spec)
    assert (wide.head_dim, wide.num_kv_heads, wide.intermediate_size) == (32, 2, 192)
    config = EngineConfig(model=str(family_model_dir("gemma4")), device="cpu")
    uniform = replace(spec, layer_head_dims=(), layer_kv_heads=(), layer_intermediate_sizes=())
    args = (config, torch.bfloat16, 64, 64, 1)
    assert step_bytes(spec, *args) == step_bytes(wide, *args) > step_bytes(uniform, *args)


def _own_kv_projections(spec, layer: int) -> int:
    """How many of k_proj and v_proj `layer` has, from the config's fields: none when it
    reads another layer's KV, k_proj alone on a full layer under attention_k_eq_v."""
    if spec.kv_sources[layer] != layer:
        return 0
    return 1 if spec.k_eq_v and not spec.is_sliding(layer) else 2


def test_qkv_weights_hold_only_the_projections_a_layer_has():
    """A KV-sharing layer's qkv weight is q_proj's rows alone (a full layer's whose values
    are the keys' q_proj's and k_proj's) and its LoRA group has those slices; the plan's
    weight bytes are what the model holds, less by exactly the zero k/v rows the plan
    counted when every layer held q, k and v (an unshared spec's plan, less the k_norms
    only KV-owning layers have)."""
    from dataclasses import replace

    from replica.executor.memory_plan import weight_bytes
    from replica.model.decoder import CausalLM
    from replica.model.lora_slots import LoRASlotBuffers
    from tests.engines import held_bytes

    model_dir = family_model_dir("gemma4")
    spec, meta, b = load_model_spec(model_dir), torch.device("meta"), torch.bfloat16
    lora = LoRASlotBuffers(spec, 3, 8, meta, b)
    model = CausalLM(model_dir, meta, b, lora, spec, None, "dummy")
    h, zero_rows, k_norms = spec.hidden_size, 0, 0
    for i, layer in enumerate(model.layers):
        own = spec.layer(i)
        kv = _own_kv_projections(spec, i)
        rows = own.q_proj_size + kv * own.kv_size
        assert layer.qkv_proj.weight.shape == (rows, h), i
        assert layer.qkv_proj.weight.nbytes == rows * h * b.itemsize
        names = ("q_proj", "k_proj", "v_proj")[: 1 + kv]
        group = layer.qkv_proj.lora
        assert group.slice_names == names and group.slice_offsets[-1] == rows, i
        zero_rows += (2 - kv) * own.kv_size
        k_norms += (kv == 0) * own.head_dim
    assert zero_rows == 2 * (16 * 2) + 2 * 32 + 2 * 32  # 2 sharing layers, 2 with k_eq_v
    assert weight_bytes(spec, 1, b) == held_bytes(model)
    unshared = replace(spec, kv_sources=(), k_eq_v=False)
    every_layer_qkv = weight_bytes(unshared, 1, b) - k_norms * 4  # norms held in fp32
    assert every_layer_qkv - weight_bytes(spec, 1, b) == zero_rows * h * b.itemsize


def test_lora_on_kv_projections_a_layer_lacks_is_skipped_as_peft_drops_it(tmp_path):
    """An adapter file that also holds k_proj / v_proj LoRA on the layers without them
    (the KV-sharing layers; v_proj on the full layers): PEFT loads it and drops those
    tensors (transformers' layers have no such modules), so the served adapter skips them:
    its report counts k_proj on the 4 layers having it, v_proj on 2, it holds the bytes of
    the modules it applies, and its logits and greedy tokens in a mixed batch equal
    transformers + PEFT's."""
    from safetensors.torch import save_file

    from replica.model.peft_config import AdapterFormatError

    model_dir = family_model_dir("gemma4")
    spec = load_model_spec(model_dir)
    path = peft_adapter(model_dir, tmp_path / "qkv", ["q_proj", "k_proj", "v_proj"], r=4,
                        alpha=8, seed=8)  # fmt: skip
    plain = load_peft_adapter(path, spec, 64, "qkv")
    tensors = load_file(path / "adapter_model.safetensors")
    g, extra = torch.Generator().manual_seed(9), {}
    for layer in range(spec.num_layers):
        for module in ("k_proj", "v_proj"):
            if spec.has_kv_projection(layer, module):
                continue
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            extra[f"{key}.lora_A.weight"] = torch.randn(4, spec.hidden_size, generator=g)
            extra[f"{key}.lora_B.weight"] = torch.randn(spec.layer(layer).kv_size, 4, generator=g)
    assert len(extra) == 2 * (2 + 2 + 2)  # k and v on layers 4, 5; v on layers 1, 3
    save_file({**tensors, **extra}, path / "adapter_model.safetensors")
    weights = load_peft_adapter(path, spec, 64, "qkv")
    assert weights.applied() == {"self_attn.q_proj": 6, "self_attn.k_proj": 4,
                                 "self_attn.v_proj": 2}  # fmt: skip
    assert weights.nbytes == plain.nbytes and weights.weights.keys() == plain.weights.keys()
    eng = engine_for(model_dir, {"qkv": path})
    got = check_mixed_batch(eng, model_dir, {"qkv": path}, prompts(spec.vocab_size), NEW_TOKENS)
    assert got["qkv"] != got[None]
    only = tmp_path / "only"
    only.mkdir()
    (only / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    save_file(extra, only / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="12 on k/v projections their layers lack"):
        load_peft_adapter(only, spec, 64, "only")


def test_a_checkpoint_holding_kv_sharing_layers_own_kv_tensors_loads_as_transformers(tmp_path):
    """A checkpoint may hold k/v projections and norms on the KV-sharing layers (4 and 5),
    which attend over layers 2's and 3's KV: transformers drops them on load, and so do we
    (the logits are both engines' on the checkpoint without them); any other tensor there
    is still refused by name."""
    model_dir = family_model_dir("gemma4")
    copy = tmp_path / "gemma4"
    shutil.copytree(model_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    spec = load_model_spec(model_dir)
    gen = torch.Generator().manual_seed(3)
    for layer in (4, 5):
        own = spec.layer(layer)
        where = f"model.layers.{layer}.self_attn."
        for proj in ("k_proj", "v_proj"):
            rows = own.num_kv_heads * own.head_dim
            tensors[where + proj + ".weight"] = torch.randn(rows, spec.hidden_size, generator=gen)
        tensors[where + "k_norm.weight"] = torch.randn(own.head_dim, generator=gen)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    p = prompts(spec.vocab_size)[1]
    want = engine_for(model_dir, {}).score(p)
    assert torch.equal(engine_for(copy, {}).score(p), want)
    assert torch.allclose(hf_logits(hf_model(copy, eager=True), p), want, atol=LOGIT_ATOL)
    tensors["model.layers.4.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="'model.layers.4.self_attn.extra_proj.weight'"):
        engine_for(copy, {})
