"""Demo assets are real HF model dirs and exact PEFT adapters, checked with transformers + peft."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here must load from local files

import copy
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from cluster.demo import assets as demo_assets
from cluster.demo.assets import (
    LLAMA3_ROPE_SCALING,
    DemoAssets,
    DemoSpec,
    build_demo_assets,
    cached_demo_assets,
    tiny_spec,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The quick server loads a batch of tokens.",
    "Hello world, 12345 adapters!",
    "Kalomi said the river was dark; the replica kept 42 slots.",
]
TINY = {
    "llama": tiny_spec("llama"),
    "mistral": tiny_spec("mistral"),
    "qwen2": tiny_spec("qwen2"),
    "llama3-rope": tiny_spec("llama", rope_scaling=LLAMA3_ROPE_SCALING),
}


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> dict[str, tuple[DemoSpec, DemoAssets]]:
    root = tmp_path_factory.mktemp("demo")
    return {name: (spec, build_demo_assets(root / name, spec)) for name, spec in TINY.items()}


@pytest.fixture(scope="session")
def default_build(demo) -> tuple[DemoSpec, DemoAssets]:
    """The default demo as the machine's cache holds it (built by the same builder, once
    per machine, for every test that runs on it)."""
    return DemoSpec(), demo


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _load_model(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing/unexpected/mismatched keys or errors
    return model.eval()


def _prompt_ids(tok) -> list[torch.Tensor]:
    return [torch.tensor([tok(p).input_ids]) for p in PROMPTS]


@torch.no_grad()
def _greedy(model, ids: torch.Tensor, n: int = 8) -> list[int]:
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, -n:].tolist()


def test_spec_validation():
    with pytest.raises(ValueError):
        DemoSpec(arch="gpt2")
    with pytest.raises(ValueError):
        DemoSpec(num_heads=8, num_kv_heads=3)
    assert tiny_spec("qwen2").tie_word_embeddings and not tiny_spec("llama").tie_word_embeddings


def test_layout(builds):
    spec, assets = builds["llama"]
    assert list(assets.adapters) == [f"adapter-{i:02d}" for i in range(spec.num_adapters)]
    assert all((d / "adapter_config.json").is_file() for d in assets.adapters.values())
    manifest = json.loads((assets.root / "lorafleet_demo.json").read_text())
    assert manifest["spec"]["hidden_size"] == 64 and manifest["format_version"] >= 1
    assert not [p for p in assets.root.parent.iterdir() if p.name.startswith(".")]  # no temp dirs


def test_build_is_deterministic(builds, tmp_path):
    spec, first = builds["qwen2"]
    again = build_demo_assets(tmp_path / "again", spec)
    assert _files(first.root) == _files(again.root)


def test_second_build_rewrites_nothing(builds):
    spec, assets = builds["mistral"]
    mtimes = {p: p.stat().st_mtime_ns for p in assets.root.rglob("*")}
    assert build_demo_assets(assets.root, spec) == assets
    assert mtimes == {p: p.stat().st_mtime_ns for p in assets.root.rglob("*")}


def test_other_spec_replaces_build_and_foreign_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    first = load_file(build_demo_assets(out, tiny_spec()).model_dir / "model.safetensors")
    assets = build_demo_assets(out, tiny_spec(seed=1))
    assert json.loads((out / "lorafleet_demo.json").read_text())["spec"]["seed"] == 1
    second = load_file(assets.model_dir / "model.safetensors")
    assert not torch.equal(first["model.norm.weight"], second["model.norm.weight"])
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_demo_assets(tmp_path / "foreign", tiny_spec())


def test_losing_the_rename_race_accepts_the_winner(tmp_path, monkeypatch):
    out, real_build = tmp_path / "out", demo_assets._build_tree

    def build_then_lose_race(root: Path, spec: DemoSpec) -> None:
        real_build(root, spec)
        shutil.copytree(root, out)  # another process finished the same spec first

    monkeypatch.setattr(demo_assets, "_build_tree", build_then_lose_race)
    assets = build_demo_assets(out, tiny_spec())
    assert assets.root == out and (out / "lorafleet_demo.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # our temp tree is gone


def test_cached_demo_assets(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path))
    assets = cached_demo_assets(tiny_spec())
    assert assets.root.parent == tmp_path and assets.root.name.startswith("demo-llama-")
    assert len(assets.root.name) == len("demo-llama-") + 12
    assert cached_demo_assets(tiny_spec()) == assets
    other = cached_demo_assets(tiny_spec(seed=3), cache_root=tmp_path / "c")
    assert other.root.parent == tmp_path / "c" and other.root.name != assets.root.name


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tokenizer(builds, name):
    from tokenizers import Tokenizer

    spec, assets = builds[name]
    tok = transformers.AutoTokenizer.from_pretrained(assets.model_dir)
    assert len(tok) == spec.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    config = json.loads((assets.model_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    raw = Tokenizer.from_file(str(assets.model_dir / "tokenizer.json"))
    for text in [*PROMPTS, "  odd\tspacing\n\nand symbols #$%^&*() ~`|"]:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids and tok.bos_token_id not in ids  # no auto bos
        assert tok.decode(ids) == text
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nHi there</s>\n<|assistant|>\nHello</s>\n<|assistant|>\n"
    ids = tok.apply_chat_template(chat[:1], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("<|assistant|>\n")


def test_vocab_beyond_the_corpus_is_filled_with_reserved_tokens(tmp_path):
    assets = build_demo_assets(tmp_path / "big", tiny_spec(vocab_size=5000, num_adapters=0))
    tok = transformers.AutoTokenizer.from_pretrained(assets.model_dir)
    assert len(tok) == 5000 and tok.convert_ids_to_tokens(4999).startswith("<|reserved_")
    assert assets.adapters == {}


def _check_model(spec: DemoSpec, assets: DemoAssets) -> None:
    config = json.loads((assets.model_dir / "config.json").read_text())
    assert config["dtype"] == "float32" and config["head_dim"] == spec.head_dim
    model = _load_model(assets.model_dir)
    with safe_open(assets.model_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    expected = set(model.state_dict()) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    assert keys == expected
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (spec.arch == "qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(assets.model_dir)
    gaps = []
    with torch.no_grad():
        for ids in _prompt_ids(tok):
            logits = model(ids).logits[0]
            assert torch.isfinite(logits).all() and 3.0 < logits.std(-1).mean() < 10.0
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
    # measured ~1.6-2.2; greedy decoding must not hinge on 1e-5 numerical noise
    assert torch.cat(gaps).mean() > 0.5


@pytest.mark.parametrize("name", list(TINY))
def test_model_loads_and_logits_are_peaky(builds, name):
    _check_model(*builds[name])


def test_default_spec_model(default_build):
    _check_model(*default_build)


def _check_adapters(assets: DemoAssets, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict

    base = _load_model(assets.model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(assets.model_dir)
    prompts = _prompt_ids(tok)
    base_out = [_greedy(base, ids) for ids in prompts]
    for name, adapter_dir in assets.adapters.items():
        written = json.loads((adapter_dir / "adapter_config.json").read_text())
        # every field we write is a LoraConfig field and holds what peft itself would write
        chosen = ("r", "lora_alpha", "target_modules", "use_rslora", "base_model_name_or_path")
        fields = {k: written[k] for k in chosen}
        reference = LoraConfig(
            task_type="CAUSAL_LM", lora_dropout=0.0, inference_mode=True, **fields
        ).to_dict()
        for key, value in written.items():
            ref = reference[key]
            assert (sorted(ref) if isinstance(ref, set) else ref) == value, (name, key)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
        assert not [w for w in caught if "missing" in str(w.message).lower()]
        assert not [w for w in caught if "unexpected" in str(w.message).lower()]
        config = model.peft_config["default"]
        assert (config.r, config.lora_alpha, config.use_rslora) == (
            written["r"],
            written["lora_alpha"],
            written["use_rslora"],
        )
        assert set(config.target_modules) == set(written["target_modules"])
        tensors = load_file(adapter_dir / "adapter_model.safetensors")
        loaded = get_peft_model_state_dict(model, save_embedding_layers=False)
        assert set(loaded) == set(tensors)
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
        assert all(t.dtype == torch.float32 for t in tensors.values())
        # peft's own save of the loaded adapter writes the same keys and shapes
        model.save_pretrained(tmp_path / name, save_embedding_layers=False)
        resaved = load_file(tmp_path / name / "adapter_model.safetensors")
        assert {k: v.shape for k, v in resaved.items()} == {k: v.shape for k, v in tensors.items()}
        outs = [_greedy(model, ids) for ids in prompts]
        assert outs != base_out, name


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.slow
def test_adapters_load_in_peft_and_change_outputs(builds, name, tmp_path):
    _check_adapters(builds[name][1], tmp_path)


@pytest.mark.slow
def test_default_spec_adapters(default_build, tmp_path):
    _check_adapters(default_build[1], tmp_path)
