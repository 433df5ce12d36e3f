"""PEFT adapter features beyond plain LoRA, each against PEFT itself on the tiny Llama:
.bin weights, rank_pattern / alpha_pattern (with and without rsLoRA), layers_to_transform,
a mixed batch of them; and the refusals of what the engine cannot serve exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from replica.adapters.sources import PeftDirectorySource
from replica.model.adapter_weights import (
    AdapterFormatError,
    convert_peft_tensors,
    load_peft_adapter,
)
from replica.model.peft_config import pattern_key
from replica.model.spec import load_model_spec
from replica.wire import SamplingParams
from tests.engines import make_engine
from tests.oracle import build_peft_adapter, hf_greedy, hf_logits, hf_model
from tests.replica.model.families import LOGIT_ATOL

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
PROMPTS = ([5, 17, 99, 200, 33, 7], [3, 44, 401, 12, 250, 9, 77, 310, 18, 66, 120])
# q_proj everywhere rank 4, layer 1's down_proj rank 16, the rest r=8; alphas differ too
PATTERN = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ALL,
    "rank_pattern": {"q_proj": 4, "model.layers.1.mlp.down_proj": 16},
    "alpha_pattern": {"v_proj": 5, "layers.0.mlp.down_proj": 24},
}
# name -> (LoraConfig kwargs, save_pretrained(safe_serialization=...))
ADAPTERS = {
    "plain": (
        {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        True,
    ),
    "bin": ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}, False),
    "pattern": (PATTERN, True),
    "pattern-rslora": ({**PATTERN, "use_rslora": True}, True),
    "layers1": ({"r": 4, "lora_alpha": 8, "target_modules": ALL, "layers_to_transform": [1]}, True),
}


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-adapters")
    return {
        name: build_peft_adapter(tiny.model_dir, root / name, seed, safe, **kwargs)
        for seed, (name, (kwargs, safe)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def engine(tiny, built):
    return make_engine(tiny, built, kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def refs(tiny, built):
    """PEFT's logits and greedy ids of every adapter (and the base) on PROMPTS."""
    out = {}
    for name, path in [(None, None), *built.items()]:
        model = hf_model(tiny.model_dir, path)
        out[name] = [(hf_logits(model, p), hf_greedy(model, p, N_NEW)) for p in PROMPTS]
    return out


def assert_matches_peft(engine, refs, name):
    for p, (logits, greedy) in zip(PROMPTS, refs[name], strict=True):
        diff = (engine.score(p, name) - logits).abs().max().item()
        assert diff < LOGIT_ATOL, f"{name}: max |logit - peft logit| = {diff}"
        assert engine.generate([(p, GREEDY, name)])[0].output_ids == greedy, name
    base = refs[None][0][0]
    assert (refs[name][0][0] - base).abs().max().item() > 1.0, "the adapter should matter"


# -- .bin adapters -----------------------------------------------------------------------------


def test_bin_adapter_matches_peft(built, engine, refs):
    files = {p.name for p in built["bin"].iterdir()}
    assert "adapter_model.bin" in files and "adapter_model.safetensors" not in files
    assert_matches_peft(engine, refs, "bin")


def test_safetensors_preferred_over_bin(tiny, built, tmp_path):
    spec = load_model_spec(tiny.model_dir)
    dst = tmp_path / "both"
    shutil.copytree(built["plain"], dst)
    (dst / "adapter_model.bin").write_bytes(b"not read: safetensors comes first")
    adapter = load_peft_adapter(dst, spec, 64)
    want = load_file(dst / "adapter_model.safetensors")
    a, _ = adapter.weights[(0, "q_proj")]
    assert torch.equal(a, want["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])


def test_corrupt_bin_is_named(tiny, built, tmp_path):
    spec = load_model_spec(tiny.model_dir)
    dst = tmp_path / "bad"
    shutil.copytree(built["bin"], dst)
    weights = dst / "adapter_model.bin"
    weights.write_bytes(b"garbage")
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.bin: unreadable PyTorch"):
        load_peft_adapter(dst, spec, 64)
    torch.save({"base_model.model.x": [1, 2]}, weights)  # loads, but is no state dict
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.bin: expected a state dict"):
        load_peft_adapter(dst, spec, 64)
    torch.save({"w": torch.nn.Linear(2, 2)}, weights)  # a pickled object: weights_only refuses
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.bin: unreadable PyTorch"):
        load_peft_adapter(dst, spec, 64)


# -- rank_pattern / alpha_pattern --------------------------------------------------------------


@pytest.mark.parametrize("name", ["pattern", "pattern-rslora"])
def test_rank_and_alpha_pattern_match_peft(tiny, built, engine, refs, name):
    spec = load_model_spec(tiny.model_dir)
    adapter = load_peft_adapter(built[name], spec, 64)
    assert adapter.rank == 16  # the largest module rank (layer 1's down_proj)
    a, b = adapter.weights[(0, "q_proj")]  # held at its own rank 4, not padded
    assert a.shape == (4, spec.hidden_size) and b.shape[1] == 4
    assert adapter.group_rank(("down_proj",)) == 16 and adapter.group_rank(("o_proj",)) == 8
    assert_matches_peft(engine, refs, name)


def test_pattern_max_rank_is_checked(tiny, built):
    spec = load_model_spec(tiny.model_dir)
    with pytest.raises(
        AdapterFormatError, match=r"rank 16 \(layer 1 down_proj\) exceeds max_lora_rank 8"
    ):
        load_peft_adapter(built["pattern"], spec, 8)


def test_the_directory_source_records_each_groups_rank_at_registration(tiny, built):
    """The rank per projection group, from the converted weights (rank_pattern counted):
    the pattern adapter's down_proj is rank 16 in layer 1, its attention 4 and 8."""
    source = PeftDirectorySource(load_model_spec(tiny.model_dir), 64, built)
    pattern = load_peft_adapter(built["pattern"], load_model_spec(tiny.model_dir), 64)
    assert source.ranks("pattern")["down_proj"] == 16
    assert source.ranks("pattern")["o_proj"] == pattern.group_rank(("o_proj",)) == 8
    assert set(source.ranks("plain").values()) == {8}
    with pytest.raises(AdapterFormatError):  # refused at registration: nothing recorded
        source.add("broken", built["pattern"].parent / "missing")
    assert "broken" not in source


def test_rank_disagreeing_with_config_is_named(tiny, built, tmp_path):
    spec = load_model_spec(tiny.model_dir)
    dst = tmp_path / "lie"
    shutil.copytree(built["pattern"], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"q_proj": 2, "model.layers.1.mlp.down_proj": 16}
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        AdapterFormatError,
        match=r"layer 0 q_proj: .* rank 4, but adapter_config.json rank_pattern\['q_proj'\]=2",
    ):
        load_peft_adapter(dst, spec, 64)


def test_pattern_key_is_peft_rule():
    from peft.utils.other import get_pattern_key

    patterns = [
        {"q_proj": 1},
        {"model.layers.1.mlp.down_proj": 1, "down_proj": 2},
        {"down_proj": 2, "model.layers.1.mlp.down_proj": 1},  # order decides
        {"layers.1.mlp.down_proj": 1},
        {"1.mlp.down_proj": 1},
        {"ers.1.mlp.down_proj": 1},  # not at a name boundary: no match
        {r"layers\.\d\.self_attn\.(q|k)_proj": 3},
        {"^model.layers.0.self_attn.v_proj": 1},
        {"proj": 1},
        {"mlp": 1},
    ]
    paths = [
        f"model.layers.{i}.{group}.{m}"
        for i in range(2)
        for group, mods in [("self_attn", ALL[:4]), ("mlp", ALL[4:])]
        for m in mods
    ] + ["model.language_model.layers.1.mlp.down_proj"]
    for pattern in patterns:
        for path in paths:
            assert pattern_key(pattern, path) == get_pattern_key(pattern.keys(), path), (
                pattern,
                path,
            )


# -- layers_to_transform / layers_pattern ------------------------------------------------------


def test_layers_to_transform_matches_peft(tiny, built, engine, refs):
    spec = load_model_spec(tiny.model_dir)
    adapter = load_peft_adapter(built["layers1"], spec, 64)
    assert {layer for layer, _ in adapter.weights} == {1}
    assert_matches_peft(engine, refs, "layers1")


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"layers_to_transform": [0]}, r"is in a layer outside layers_to_transform=\[0\]"),
        ({"layers_to_transform": 0}, r"is in a layer outside layers_to_transform=0"),
        (
            {"layers_pattern": "h"},
            r"is in a layer outside layers_to_transform=\[1\], layers_pattern='h'",
        ),
        ({"layers_to_transform": "1"}, r"layers_to_transform='1' is not a layer index"),
    ],
    ids=["other-layer", "other-layer-int", "other-pattern", "not-an-index"],
)
def test_weights_outside_layers_to_transform_refused(tiny, built, tmp_path, changes, match):
    spec = load_model_spec(tiny.model_dir)
    cfg = json.loads((built["layers1"] / "adapter_config.json").read_text())
    tensors = load_file(built["layers1"] / "adapter_model.safetensors")
    assert convert_peft_tensors("ok", {**cfg, "layers_pattern": "layers"}, tensors, spec, 64)
    with pytest.raises(AdapterFormatError, match=match):
        convert_peft_tensors("a", {**cfg, **changes}, tensors, spec, 64)


# -- one engine, one batch ---------------------------------------------------------------------


def test_mixed_batch_matches_peft(engine, refs):
    names = ["pattern", "plain", None, "pattern-rslora", "bin", "layers1"]
    requests = [(p, GREEDY, n) for n in names for p in PROMPTS]
    out = engine.generate(requests)
    got = [seq.output_ids for seq in out]
    want = [greedy for n in names for _, greedy in refs[n]]
    assert got == want


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("use_dora", True, "use_dora=True: DoRA is not supported"),
        ("modules_to_save", ["lm_head"], r"modules_to_save=\['lm_head'\]: .* not supported"),
        ("trainable_token_indices", [3, 4], r"trainable_token_indices=\[3, 4\]: trainable tokens"),
        ("layer_replication", [[0, 2], [1, 2]], r"layer_replication=.*: layer replication"),
        ("use_qalora", True, "use_qalora=True: QALoRA"),
        ("lora_bias", True, "lora_bias=True: a bias on lora_B is not supported"),
        ("alora_invocation_tokens", [7, 8], r"alora_invocation_tokens=\[7, 8\]: aLoRA"),
        ("target_parameters", ["self_attn.q_proj.weight"], "target_parameters=.*only on a mixture"),
        ("arrow_config", {"top_k": 3}, "arrow_config=.*: Arrow routing is not supported"),
        ("use_bdlora", {"nblocks": 2}, "use_bdlora=.*: BD-LoRA"),
        ("kasa_config", {}, "kasa_config={}: KaSA"),  # PEFT makes a default KaSA config of {}
        ("arrow_config", None, None),
        ("bias", "lora_only", "bias='lora_only' is not supported"),
        ("fan_in_fan_out", True, "fan_in_fan_out=true is not supported"),
        ("init_lora_weights", "pissa", "init_lora_weights='pissa' .* rewrites the base"),
        ("init_lora_weights", "pissa_niter_4", "init_lora_weights='pissa_niter_4'"),
        ("init_lora_weights", "olora", "init_lora_weights='olora'"),
        ("init_lora_weights", "corda", "init_lora_weights='corda'"),
        ("init_lora_weights", "loftq", "init_lora_weights='loftq'"),
        ("init_lora_weights", "lora_ga", "init_lora_weights='lora_ga'"),
        # plain at inference: accepted
        ("init_lora_weights", "gaussian", None),
        ("init_lora_weights", "mica", None),
        ("trainable_token_indices", [], None),
        ("alora_invocation_tokens", None, None),
        ("exclude_modules", ["o_proj"], None),
    ],
)
def test_config_refusals_name_the_field(tiny, built, field, value, match):
    spec = load_model_spec(tiny.model_dir)
    cfg = json.loads((built["plain"] / "adapter_config.json").read_text())
    tensors = load_file(built["plain"] / "adapter_model.safetensors")
    config = {**cfg, field: value}
    if match is None:
        assert convert_peft_tensors("a", config, tensors, spec, 64).rank == 8
    else:
        with pytest.raises(AdapterFormatError, match=match):
            convert_peft_tensors("a", config, tensors, spec, 64)


@pytest.mark.parametrize(
    "target,key",
    [
        ("embed_tokens", "base_model.model.model.embed_tokens.lora_embedding_A"),
        ("lm_head", "base_model.model.lm_head.lora_A.weight"),
    ],
)
def test_lora_on_embeddings_or_head_refused_unless_enabled(tiny, tmp_path, target, key):
    """Served with engine.lora_embeddings (tests/replica/model/test_vocab_lora.py); off,
    refused naming the tensor and the setting."""
    spec = load_model_spec(tiny.model_dir)
    path = build_peft_adapter(
        tiny.model_dir, tmp_path / target, 7, r=4, target_modules=["q_proj", target]
    )
    assert key in load_file(path / "adapter_model.safetensors")
    with pytest.raises(
        AdapterFormatError,
        match=rf"tensor 'base_model\.model\.(model\.)?{target}\.[\w.]+' is LoRA on "
        r"embed_tokens/lm_head, which this server does not serve \(engine.lora_embeddings",
    ):
        load_peft_adapter(path, spec, 64)
    assert target in load_peft_adapter(path, spec, 64, lora_embeddings=True).target_modules


def test_bad_patterns_are_named(tiny, built):
    spec = load_model_spec(tiny.model_dir)
    cfg = json.loads((built["plain"] / "adapter_config.json").read_text())
    tensors = load_file(built["plain"] / "adapter_model.safetensors")
    for changes, match in [
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]=0 is not a positive"),
        ({"rank_pattern": {"q_proj": 4.0}}, r"rank_pattern\['q_proj'\]=4.0 is not a positive"),
        ({"alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\]='x' is not a finite"),
        ({"rank_pattern": [4]}, r"rank_pattern=\[4\] is not a mapping"),
        ({"alpha_pattern": {"(": 4}}, r"alpha_pattern key '\(' is not a valid regular exp"),
    ]:
        with pytest.raises(AdapterFormatError, match=match):
            convert_peft_tensors("a", {**cfg, **changes}, tensors, spec, 64)
