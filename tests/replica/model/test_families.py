"""Every family against the outside oracle: transformers (eager attention) + PEFT, fp32.

Each family's tiny model (cluster/demo/families.py) has its quirks set so they bite: a
sliding window shorter than the prompts, heads × head_dim ≠ hidden, perturbed norm and
q/k-norm weights, soft-caps that change scores and logits, query_pre_attn_scalar ≠
head_dim, partial rotary. One engine per family serves the base and two adapters written
by peft itself, in one mixed batch, with chunked prefill.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from replica.model.decoder import CausalLM
from replica.model.rope import RotaryEmbedding
from tests.conftest import tiny_assets
from tests.oracle import (
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
    NEW_TOKENS,
    check_base_unchanged_beside_adapters,
    engine_for,
    prompts,
    traced_static_decode,
)

FAMILIES = ["qwen3", "gemma2", "gemma3", "gemma3-mm", "phi3"]  # Gemma ties its head


# The paths past the forward (prefix-cache hits, the static decode step) on the families
# whose layers differ most: windows and soft-caps, local rope and q/k norms, fused
# checkpoints and partial rotary, sinks and experts (Qwen3's differences are all in the
# forward above).
DECODE_PATH_FAMILIES = ["gemma2", "gemma3-mm", "phi3", "gptoss"]


def _family(name: str, tmp_path_factory):
    model_dir = family_model_dir(name)
    return name, model_dir, family_adapters(name, model_dir, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=DECODE_PATH_FAMILIES)
def decode_family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.mark.slow
def test_family_matches_transformers_and_peft_in_one_mixed_batch(family):
    name, model_dir, adapters = family
    eng = engine_for(model_dir, adapters)
    got = check_mixed_batch(eng, model_dir, adapters, prompts(eng.spec.vocab_size), NEW_TOKENS)
    assert got[None] != got["all"], f"{name}: the adapter should change the continuation"


def test_each_rope_table_is_gathered_once_a_step(monkeypatch):
    """Gemma 3's local and global ropes: every step gathers each table's cos and sin at
    its positions once, for all the layers sharing it (not once a layer)."""
    eng = engine_for(family_model_dir("gemma3"), {})
    gathered, forwards = [], []
    at, forward = RotaryEmbedding.at, CausalLM.forward

    def counted_at(rope, positions):
        gathered.append(rope)
        return at(rope, positions)

    def counted_forward(model, *args, **kwargs):
        forwards.append(model)
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "at", counted_at)
    monkeypatch.setattr(CausalLM, "forward", counted_forward)
    eng.generate([(prompts(eng.spec.vocab_size)[1], GREEDY, None)])
    ropes = eng.executor.model.ropes
    assert len(ropes) == 2 and len({id(layer.rope) for layer in eng.executor.model.layers}) == 2
    assert len(forwards) > NEW_TOKENS  # chunked prefill steps, then decode steps
    assert gathered == ropes * len(forwards)


def test_phi3_fused_projections_are_held_fused(tmp_path):
    """Phi-3's adapters target qkv_proj and gate_up_proj: each is one slice of its group
    (A stored once, not once per part), and the memory budget counts it so."""
    from replica.adapters.memory import slot_bytes
    from replica.model.adapter_weights import load_peft_adapter
    from replica.model.spec import load_model_spec

    model_dir = family_model_dir("phi3")
    spec = load_model_spec(model_dir)
    adapter = load_peft_adapter(family_adapters("phi3", model_dir, tmp_path)["all"], spec, 64)
    assert {m for _, m in adapter.weights} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    eng = engine_for(model_dir, {})
    try:
        groups = eng.executor.lora.layers[0]
        assert groups["qkv_proj"].slice_names == ("qkv_proj",)
        assert groups["gate_up_proj"].slice_names == ("gate_up_proj",)
    finally:
        eng.shutdown()
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    fused = h + (q + 2 * kv) + (q + h) + h + 2 * i + (i + h)  # A + B rows of each group
    assert slot_bytes(spec, 1, torch.float32) == 4 * spec.num_layers * fused


def test_gemma3_multimodal_checkpoint_in_transformers5_layout(tmp_path):
    """transformers 5 keeps the language model under model.language_model.*; the Hub's
    files (and save_pretrained) under language_model.model.*: both serve the same."""
    src = family_model_dir("gemma3-mm")
    dst = tmp_path / "gemma3-mm-v5"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    renamed = {k.replace("language_model.model.", "model.language_model."): v
               for k, v in tensors.items()}  # fmt: skip
    assert renamed != tensors
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = engine_for(dst, {}), engine_for(src, {})
    p = prompts(ours.spec.vocab_size)[1]
    assert torch.equal(ours.score(p), theirs.score(p))


def test_gemma3_multimodal_ignores_vision_lora(tmp_path):
    """A PEFT config naming q_proj also adapts the vision tower's attention; images are not
    served, so those weights are skipped and the text output equals PEFT's."""
    model_dir = family_model_dir("gemma3-mm")
    path = peft_adapter(model_dir, tmp_path / "a", ["q_proj", "v_proj"], r=8, alpha=8, seed=3)
    assert any("vision_tower" in k for k in load_file(path / "adapter_model.safetensors"))
    eng = engine_for(model_dir, {"a": path})
    ref = hf_model(model_dir, path, eager=True)
    p = prompts(eng.spec.vocab_size)[1]
    assert (eng.score(p, "a") - hf_logits(ref, p)).abs().max().item() < LOGIT_ATOL


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
            "long_factor": [1.0, 3.0, 8.0, 16.0]}  # fmt: skip
ROPE_VARIANTS = {
    # Qwen long-context configs: yarn over a 64-token original context
    "qwen3-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}}),
    # Phi-3 128k's longrope (the original context at the config's top level); every prompt
    # and continuation stays inside it, where transformers uses the short factors too
    "phi3-longrope": ("phi3", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 64}),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_types_of_real_checkpoints_match_transformers(variant, tmp_path):
    family, overrides = ROPE_VARIANTS[variant]
    model_dir = family_model_dir(family, overrides=overrides)
    adapter = family_adapters(family, model_dir, tmp_path)["attn"]
    eng = engine_for(model_dir, {"attn": adapter})
    assert eng.spec.rope_scaling["rope_type"] == overrides["rope_scaling"]["rope_type"]
    refs = {None: hf_model(model_dir, eager=True), "attn": hf_model(model_dir, adapter, True)}
    ps = prompts(eng.spec.vocab_size)
    for name, ref in refs.items():
        for p in ps:
            assert (eng.score(p, name) - hf_logits(ref, p)).abs().max().item() < LOGIT_ATOL
    outputs = eng.generate([(p, GREEDY, name) for p in ps for name in refs])
    want = [hf_greedy(ref, p, NEW_TOKENS) for p in ps for ref in refs.values()]
    assert [s.output_ids for s in outputs] == want


def test_prefix_cache_hits_on_sliding_layers_give_the_uncached_output(decode_family):
    """Prompts that extend an earlier one start after its cached blocks (which sliding
    and global layers alike read): each equals transformers' output for the whole prompt."""
    name, model_dir, adapters = decode_family
    # gpt-oss's "all" adapter is on its experts too: lora_experts on every family alike
    eng = engine_for(model_dir, adapters, enable_prefix_caching=True, lora_experts=True)
    refs = {
        None: hf_model(model_dir, eager=True),
        "all": hf_model(model_dir, adapters["all"], True),
    }
    first = prompts(eng.spec.vocab_size)[1]  # 40 tokens: ten 4-token blocks
    for adapter, ref in refs.items():
        eng.generate([(first, GREEDY, adapter)])
        longer = first + [5, 6, 7, 8, 9, 10]
        (seq,) = eng.generate([(longer, GREEDY, adapter)])
        assert seq.num_cached_tokens >= 36, (name, adapter, seq.num_cached_tokens)
        assert seq.output_ids == hf_greedy(ref, longer, NEW_TOKENS), (name, adapter)


@pytest.mark.slow
def test_static_decode_path_equals_eager(decode_family):
    """The fixed-shape decode step that CUDA graphs replay: the eager
    engine's tokens, and no device value read inside the step."""
    name, model_dir, adapters = decode_family
    ps = prompts(256)
    requests = [(p, GREEDY, a) for p in ps for a in (None, *adapters)]
    experts = {"lora_experts": True}  # gpt-oss's "all" adapter is on its experts too
    want = [s.output_ids for s in engine_for(model_dir, adapters, **experts).generate(requests)]
    eng = engine_for(model_dir, adapters, **experts)
    used, reads = traced_static_decode(eng.executor, eng.config.max_num_seqs)
    assert [s.output_ids for s in eng.generate(requests)] == want, name
    assert used, "no step took the static decode path"
    assert not reads, f"{name}: the static step read device values: {reads[:3]}"


# The families whose own test file does not check it (gemma4, qwen35 and gptoss do); one
# dense and one mixture of experts in the fast unit run, the rest marked slow
BESIDE_ADAPTERS = ["llama", "mixtral", *(
    pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3", "gemma2", "gemma3", "gemma3-mm",
                                                      "phi3", "qwen3moe", "gemma4-mm",
                                                      "gemma4moe", "qwen35moe"))]  # fmt: skip


@pytest.mark.parametrize("name", BESIDE_ADAPTERS)
def test_base_requests_are_unchanged_by_sixteen_adapters_beside_them(name, tmp_path):
    if name == "llama":
        tiny = tiny_assets("llama")
        model_dir, adapters = tiny.model_dir, dict(list(tiny.adapters.items())[:2])
    else:
        model_dir = family_model_dir(name)
        adapters = family_adapters(name, model_dir, tmp_path)
    # the MoE families' "all" adapters are on their experts too
    check_base_unchanged_beside_adapters(model_dir, adapters, lora_experts=True)


# config.json as the Hub ships them (abridged to the fields the spec reads)
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}
PHI3_128K = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
}
QWEN25_YARN = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
               "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
               "vocab_size": 152064, "max_position_embeddings": 32768, "sliding_window": 131072,
               "use_sliding_window": False, "rope_theta": 1e6,
               "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                                "type": "yarn"}}  # fmt: skip


def test_hub_configs_read_as_transformers_fills_them_in():
    from replica.model.spec import spec_from_dict

    g = spec_from_dict(GEMMA3_4B)  # sparse text_config: Gemma3TextConfig's defaults fill it
    assert (g.num_heads, g.num_kv_heads, g.head_dim, g.vocab_size) == (8, 4, 256, 262_208)
    assert g.eos_token_ids == (1, 106) and g.tie_word_embeddings and g.qk_norm
    assert g.layer_types.count("full_attention") == 34 // 6 and g.sliding_window == 1024
    assert g.rope(5).theta == 1e6 and g.rope(5).scaling["factor"] == 8.0  # global layer
    assert g.rope(0).theta == 10_000.0 and g.rope(0).scaling is None  # local layer
    assert g.attn_scale == 256**-0.5 and g.embed_scale == 2560**0.5
    p = spec_from_dict(PHI3_128K)
    assert p.rope_scaling["rope_type"] == "longrope" and p.fused_qkv and p.fused_gate_up
    assert p.rope_scaling["original_max_position_embeddings"] == 4096
    q = spec_from_dict(QWEN25_YARN)
    assert q.rope_scaling["rope_type"] == "yarn" and q.sliding_window is None
    assert q.window(27) is None  # use_sliding_window false: no layer slides


def test_gemma3_defaults_are_transformers_own():
    from transformers import Gemma3TextConfig

    from replica.model.families import GEMMA3_TEXT_DEFAULTS

    hf = Gemma3TextConfig()
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key in ("rope_theta", "rope_local_base_freq"):
            theta = hf.rope_parameters["full_attention" if key == "rope_theta" else
                                        "sliding_attention"]["rope_theta"]  # fmt: skip
            assert theta == value, key
        elif key == "sliding_window_pattern":
            assert hf._sliding_window_pattern == value
        else:
            assert getattr(hf, key) == value, key


def test_configs_we_cannot_serve_are_refused_by_name():
    from replica.model.spec import ModelConfigError, spec_from_dict

    text = {**GEMMA3_4B["text_config"], "model_type": "gemma3_text"}
    with pytest.raises(ModelConfigError, match="use_bidirectional_attention"):
        spec_from_dict({**text, "use_bidirectional_attention": True})
    with pytest.raises(ModelConfigError, match="unsupported activation 'gelu'"):
        spec_from_dict({**text, "hidden_activation": "gelu"})
    with pytest.raises(ModelConfigError, match="attention_bias"):
        spec_from_dict({**PHI3_128K, "attention_bias": True})
    with pytest.raises(ModelConfigError, match="rope_type='dynamic'"):
        spec_from_dict({**QWEN25_YARN, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="model_type='deepseek_v3'"):
        spec_from_dict({**QWEN25_YARN, "model_type": "deepseek_v3"})
