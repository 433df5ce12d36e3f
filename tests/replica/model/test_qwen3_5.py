"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against the outside oracle:
transformers (eager) + PEFT, fp32.

The tiny model (cluster/demo/families.py "qwen35") is in the Hub's multimodal layout
(Qwen3_5ForConditionalGeneration: the language model under model.language_model.*, a
vision tower beside it) with every quirk biting: Gated DeltaNet layers 0 and 2 with 2 key
heads and 6 value heads (≠ the 4 attention heads), a 4-tap conv, decays spread per head;
gated full attention on layers 1 and 3 with q/k norms, an output gate and 8 of 32 dims
rotated; (1+w) norms perturbed, the gated norm's w perturbed. Prompts of 5 and 40 tokens
in 16-token steps: the 40-token one prefills in three chunks, each starting from the state
the last one left. Adapters are written by peft: linear attention only, attention only,
and every linear module.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from replica.model.peft_config import AdapterFormatError
from replica.model.spec import load_model_spec, spec_from_dict
from replica.wire import SamplingParams
from tests.engines import make_engine
from tests.oracle import (
    ATTENTION,
    EVERYTHING,
    LINEAR_ATTENTION,
    check_mixed_batch,
    hf_logits,
    hf_model,
    peft_adapter,
)
from tests.replica.model.families import (
    GREEDY,
    NEW_TOKENS,
    check_base_unchanged_beside_adapters,
    engine_for,
    prompts,
    traced_static_decode,
)

LINEAR = LINEAR_ATTENTION


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(model dir, {name: peft adapter}) built once for the module."""
    model_dir = family_model_dir("qwen35")
    root = tmp_path_factory.mktemp("qwen35")
    adapters = {
        "linear": peft_adapter(model_dir, root / "linear", LINEAR, r=8, alpha=16, seed=1),
        "attn": peft_adapter(model_dir, root / "attn", ATTENTION, r=4, alpha=8, seed=3),
        "all": peft_adapter(model_dir, root / "all", EVERYTHING + LINEAR, r=16, alpha=8, seed=2),
    }
    return model_dir, adapters


def test_qwen3_5_matches_transformers_and_peft_in_one_mixed_batch(qwen35):
    """Logits of every position within 2e-4 and greedy tokens of one mixed batch (chunked
    prefill, then decodes through the recurrent update) equal transformers + PEFT; the
    adapter on the linear-attention projections alone changes the continuation."""
    model_dir, every = qwen35
    adapters = {name: every[name] for name in ("linear", "all")}
    eng = engine_for(model_dir, adapters)
    spec = eng.spec
    assert spec.linear_attention.layers == (0, 2) and spec.kv_layers == (1, 3)
    assert len(prompts(spec.vocab_size)[1]) > eng.config.max_num_batched_tokens
    got = check_mixed_batch(eng, model_dir, adapters, prompts(spec.vocab_size), NEW_TOKENS)
    for name in adapters:
        assert got[name] != got[None], f"{name}: the adapter should change the continuation"
    assert eng.scheduler.states.num_free == eng.config.max_num_seqs  # every row back


def test_an_attention_only_adapter_equals_peft(qwen35):
    """LoRA on q/k/v/o (PEFT finds them on the attention layers only): the logits of
    every position equal transformers + PEFT's, and differ from the base's."""
    model_dir, adapters = qwen35
    eng = engine_for(model_dir, {"attn": adapters["attn"]})
    p = prompts(eng.spec.vocab_size)[1]
    ref = hf_logits(hf_model(model_dir, adapters["attn"], eager=True), p)
    assert (eng.score(p, "attn") - ref).abs().max() < 2e-4
    assert (eng.score(p) - ref).abs().max() > 0.05


def test_the_load_reports_each_layer_types_modules(qwen35, caplog):
    """An adapter on the linear attention only, one on the attention only and one on
    everything: each load (its answer and its log line) names the modules as the
    checkpoint's layers do, linear_attn.* on the Gated DeltaNet layers 0 and 2 and
    self_attn.* on the attention layers 1 and 3 apart, the MLP on all 4."""
    model_dir, adapters = qwen35
    eng = engine_for(model_dir, {})
    linear = {f"linear_attn.{m}": 2 for m in sorted(LINEAR)}
    attn = {f"self_attn.{m}": 2 for m in sorted(ATTENTION)}
    mlp = {f"mlp.{m}": 4 for m in sorted(EVERYTHING) if m not in ATTENTION}
    with caplog.at_level(logging.INFO, logger="replica.engine.engine"):
        assert eng.load_adapter("linear", adapters["linear"]).applied() == linear
        assert eng.load_adapter("attn", adapters["attn"]).applied() == attn
        assert eng.load_adapter("all", adapters["all"]).applied() == linear | mlp | attn
    logged = [r.getMessage() for r in caplog.records if "applies" in r.getMessage()]
    assert logged == [
        "adapter 'linear' applies linear_attn.in_proj_a ×2, linear_attn.in_proj_b ×2, "
        "linear_attn.in_proj_qkv ×2, linear_attn.in_proj_z ×2, linear_attn.out_proj ×2",
        "adapter 'attn' applies self_attn.k_proj ×2, self_attn.o_proj ×2, "
        "self_attn.q_proj ×2, self_attn.v_proj ×2",
        "adapter 'all' applies linear_attn.in_proj_a ×2, linear_attn.in_proj_b ×2, "
        "linear_attn.in_proj_qkv ×2, linear_attn.in_proj_z ×2, linear_attn.out_proj ×2, "
        "mlp.down_proj ×4, mlp.gate_proj ×4, mlp.up_proj ×4, self_attn.k_proj ×2, "
        "self_attn.o_proj ×2, self_attn.q_proj ×2, self_attn.v_proj ×2",
    ]


def test_each_quirk_bites(qwen35):
    """Serving with the output gate's rows of q_proj zeroed, without the conv, with no
    decay or with the gated norm's weight at 1 changes the logits by far more than the
    oracle's tolerance: the test above checks each of them."""
    model_dir, _ = qwen35
    eng = engine_for(model_dir, {})
    p = prompts(eng.spec.vocab_size)[1]
    want = eng.score(p)
    model, spec = eng.executor.model, eng.spec
    linear, full = model.layers[0].linear_attn, model.layers[1]
    hd = spec.head_dim
    ungated = full.qkv_proj.weight.clone()
    ungated[: spec.q_proj_size].view(spec.num_heads, 2, hd, -1)[:, 1] = 0  # sigmoid(0)
    identity_conv = torch.zeros_like(linear.conv_weight)
    identity_conv[:, -1] = 1
    changes = [
        ("output gate", full.qkv_proj, "weight", ungated),
        ("conv", linear, "conv_weight", identity_conv),
        ("decay", linear, "neg_decay_rate", torch.zeros_like(linear.neg_decay_rate)),
        ("gated norm", linear.norm, "weight", torch.ones_like(linear.norm.weight)),
    ]
    for quirk, obj, attr, value in changes:
        saved = getattr(obj, attr)
        setattr(obj, attr, value)
        try:
            assert (eng.score(p) - want).abs().max() > 0.05, quirk
        finally:
            setattr(obj, attr, saved)
    assert torch.equal(eng.score(p), want)


def test_base_requests_are_unchanged_by_adapters_beside_them(qwen35):
    """(Their states in other rows of the same pools.)"""
    model_dir, adapters = qwen35
    check_base_unchanged_beside_adapters(model_dir, adapters, max_num_seqs=20)


def test_state_rows_follow_the_sequences(qwen35, caplog):
    """Each running sequence holds its own state row, taken at admission and given back
    when it ends or is aborted; the prefix cache is off, said in one line at start (a hit
    would skip the state)."""
    model_dir, _ = qwen35
    with caplog.at_level("INFO", logger="replica.engine.engine"):
        eng = engine_for(model_dir, {}, max_num_seqs=4, enable_prefix_caching=True)
    assert not eng.scheduler.prefix.enabled
    assert "prefix caching is off for qwen3_5" in caplog.text
    p = prompts(eng.spec.vocab_size)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    from replica.wire import GenerateRequest

    seqs = [eng.add_request(GenerateRequest(p[i % 2], long, None)) for i in range(3)]
    eng.step()
    rows = [s.state_slot for s in seqs if s.state_slot is not None]
    assert len(rows) == len(set(rows)) >= 1
    eng.abort(seqs[0])
    assert seqs[0].state_slot is None
    while eng.has_work():
        eng.step()
    assert eng.scheduler.states.num_free == 4 and all(s.state_slot is None for s in seqs)


def test_forked_choices_start_from_their_parents_state(qwen35, monkeypatch):
    """n = 3 greedy choices of one prompt: choices 1 and 2 fork from choice 0's prefill
    (their own state rows, the parent's state copied in before the next forward), and all
    three give the tokens of the prompt alone; every row is back at the end."""
    from replica.engine.scheduler import Scheduler

    model_dir, _ = qwen35
    p = prompts(256)[1]
    want = engine_for(model_dir, {}).generate([(p, GREEDY, None)])[0].output_ids
    eng = engine_for(model_dir, {})
    forks = []
    fork = Scheduler.fork
    monkeypatch.setattr(Scheduler, "fork", lambda s, *a: forks.append(1) or fork(s, *a))
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    (first,) = eng.generate([(p, sampling, None)])
    assert forks and [c.output_ids for c in first.choices] == [want] * 3
    assert eng.scheduler.states.num_free == eng.config.max_num_seqs


def test_lora_on_a_module_the_layer_lacks_is_refused_by_name(qwen35, tmp_path):
    """q_proj LoRA on a Gated DeltaNet layer, in_proj_qkv LoRA on an attention layer and
    LoRA on the conv1d are refused naming the tensor, never loaded without it."""
    from replica.model.adapter_weights import load_peft_adapter

    model_dir, adapters = qwen35
    spec = load_model_spec(model_dir)
    cases = {
        "layers.0.self_attn.q_proj": ("q_proj", (spec.hidden_size, spec.q_proj_size)),
        "layers.1.linear_attn.in_proj_qkv": ("in_proj_qkv", (spec.hidden_size, 64)),
        "layers.0.linear_attn.conv1d": ("conv1d", (4, 4)),
    }
    for where, (_, (i, o)) in cases.items():
        bad = tmp_path / where
        shutil.copytree(adapters["linear"], bad)
        tensors = load_file(bad / "adapter_model.safetensors")
        key = f"base_model.model.model.{where}.lora_A.weight"
        tensors[key] = torch.zeros(8, i)
        tensors[key.replace("lora_A", "lora_B")] = torch.zeros(o, 8)
        save_file(tensors, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterFormatError, match=where.replace(".", r"\.")):
            load_peft_adapter(bad, spec, 64)


def test_vision_tower_and_mtp_are_known_unread():
    """The Hub's files hold a vision tower (images are not served) and multi-token
    prediction layers (speculative decoding is not served): both load as known unread."""
    from replica.model.layout import KNOWN_UNREAD

    whys = {rule.pattern: rule.why for rule in KNOWN_UNREAD if rule.arch == "qwen3_5"}
    assert any("images are not served" in why for why in whys.values())
    assert any("multi-token" in why for why in whys.values())


def test_config_reads_as_transformers_fills_it_in():
    """Qwen3_5Config's defaults (the 27B's shapes): 3 of every 4 layers linear, KV for the
    rest only, the linear heads and the partial rotary of 64 dims."""
    from transformers import Qwen3_5Config

    cfg = Qwen3_5Config().to_dict()
    spec = spec_from_dict(cfg)
    hf = Qwen3_5Config().text_config
    linear = [i for i, t in enumerate(hf.layer_types) if t == "linear_attention"]
    assert spec.linear_attention.layers == tuple(linear) and len(linear) == 24
    assert spec.kv_layers == tuple(i for i in range(32) if i not in linear)
    la = spec.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim) == (
        16, 32, 128, 128
    )  # fmt: skip
    assert spec.rotary_dim == 64 and spec.attn_output_gate and spec.gemma_norm
    assert spec.module_shapes()["q_proj"] == (4096, 2 * 16 * 256)


def test_greedy_decodes_through_the_chunked_prefill_state(qwen35):
    """One 40-token prompt prefilled in 16-token chunks then decoded gives the tokens of
    the whole prompt prefilled at once: each chunk starts from the state the last left."""
    model_dir, _ = qwen35
    p = prompts(256)[1]
    chunked = engine_for(model_dir, {}).generate([(p, GREEDY, None)])
    whole = make_engine(model_dir, {}, block_size=4, max_num_batched_tokens=64)
    assert chunked[0].output_ids == whole.generate([(p, GREEDY, None)])[0].output_ids


def test_static_decode_path_equals_eager(qwen35):
    """The fixed-shape decode step CUDA graphs replay, its state rows in the persistent
    inputs (padding rows on the scratch row): the eager engine's tokens, and no device
    value read inside the step."""
    model_dir, adapters = qwen35
    ps = prompts(256)
    requests = [(p, GREEDY, a) for p in ps for a in (None, "linear")]
    linear = {"linear": adapters["linear"]}
    want = [s.output_ids for s in engine_for(model_dir, linear).generate(requests)]
    eng = engine_for(model_dir, linear)
    used, reads = traced_static_decode(eng.executor, eng.config.max_num_seqs)
    assert [s.output_ids for s in eng.generate(requests)] == want
    assert used, "no step took the static decode path"
    assert not reads, f"the static step read device values: {reads[:3]}"


@pytest.mark.slow  # the Triton interpreter
def test_triton_kernels_give_the_torch_path_output(qwen35):
    """The model end to end with the Triton kernels forced (the interpreter here): the
    conv and the delta rule over the state pool, chunked prefill and decode, with LoRA on
    the linear-attention projections."""
    import kernels

    model_dir, adapters = qwen35
    eng = engine_for(model_dir, {"linear": adapters["linear"]})
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    p = prompts(eng.spec.vocab_size)[1][:20]  # two chunks
    requests = [(p, sampling, "linear"), (p[:5], sampling, None)]
    with kernels.forced_backend("torch"):
        want = [s.output_ids for s in eng.generate(requests)]
        want_logits = eng.score(p, "linear")
    with kernels.forced_backend("triton"):
        got = [s.output_ids for s in eng.generate(requests)]
        got_logits = eng.score(p, "linear")
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
