"""Our model and adapters against the outside oracle: transformers + PEFT, fp32 on CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from replica.engine.engine import LLMEngine
from replica.wire import SamplingParams
from tests.conftest import tiny_assets
from tests.engines import make_engine
from tests.oracle import hf_greedy, hf_logits, hf_model
from tests.replica.model.families import LOGIT_ATOL

# llama3 scaling with a short original context, so the tiny test prompts cross every band
LLAMA3_SHORT = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]


def engine_for(model_dir, **kw) -> LLMEngine:
    return make_engine(model_dir, {}, kv_cache_bytes=64 << 20, **kw)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"rope_scaling": LLAMA3_SHORT}),
        ("mistral", {}),
        ("qwen2", {}),
    ],
    ids=["llama", "llama3-rope", "mistral", "qwen2-tied-bias"],
)  # fmt: skip
@pytest.mark.slow
def test_base_model_matches_transformers(arch, overrides):
    assets = tiny_assets(arch, **overrides)
    ours, ref = engine_for(assets.model_dir), hf_model(assets.model_dir)
    for p in prompts(ours.spec.vocab_size):
        diff = (ours.score(p) - hf_logits(ref, p)).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch}: max |logit diff| {diff}"
        assert ours.generate([(p, GREEDY, None)])[0].output_ids == hf_greedy(ref, p, 32)


def test_mistral_sliding_window_matches_transformers(tmp_path):
    src = tiny_assets("mistral").model_dir
    model_dir = tmp_path / "mistral-sw"
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["sliding_window"] = 8
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ours, ref = engine_for(model_dir), hf_model(model_dir)
    assert ours.spec.sliding_window == 8
    p = prompts(ours.spec.vocab_size)[2]
    assert (ours.score(p) - hf_logits(ref, p)).abs().max().item() < LOGIT_ATOL
    assert ours.generate([(p, GREEDY, None)])[0].output_ids == hf_greedy(ref, p, 32)


@pytest.fixture(scope="module")
def demo_engine(demo):
    eng = engine_for(demo.model_dir, num_slots=len(demo.adapters) + 1)
    for name, path in demo.adapters.items():
        eng.load_adapter(name, path)
    return eng


@pytest.mark.slow
def test_demo_base_matches_transformers(demo, demo_engine):
    ref = hf_model(demo.model_dir)
    for p in prompts(demo_engine.spec.vocab_size):
        diff = (demo_engine.score(p) - hf_logits(ref, p)).abs().max().item()
        assert diff < LOGIT_ATOL, diff
    p = prompts(demo_engine.spec.vocab_size)[1]
    assert demo_engine.generate([(p, GREEDY, None)])[0].output_ids == hf_greedy(ref, p, 32)


@pytest.mark.parametrize("index", range(8))
@pytest.mark.slow
def test_demo_adapter_matches_peft(demo, demo_engine, index, record_property):
    name, path = list(demo.adapters.items())[index]
    ref = hf_model(demo.model_dir, path)
    worst = 0.0
    for p in prompts(demo_engine.spec.vocab_size):
        worst = max(worst, (demo_engine.score(p, name) - hf_logits(ref, p)).abs().max().item())
    record_property("max_abs_logit_diff", worst)
    print(f"{name}: max |logit - peft logit| = {worst:.3e}")
    assert worst < LOGIT_ATOL
    p = prompts(demo_engine.spec.vocab_size)[1]
    ours = demo_engine.generate([(p, GREEDY, name)])[0].output_ids
    assert ours == hf_greedy(ref, p, 32)
    base = demo_engine.generate([(p, GREEDY, None)])[0].output_ids
    assert ours != base, "adapter should change the greedy continuation"
