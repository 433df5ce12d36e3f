"""LoRA on embed_tokens and lm_head (engine.lora_embeddings) against transformers + PEFT.

PEFT's embedding LoRA reads A's columns by token id and adds scaling·B·that before the
embedding's scale (Gemma's √hidden applies to it too); the head's LoRA adds to the logits
of the rows whose logits are computed. Both batch with plain adapters and the base.
"""

from __future__ import annotations

import pytest
import torch

from cluster.demo.families import family_model_dir
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.model.adapter_weights import AdapterFormatError
from replica.wire import SamplingParams
from tests.conftest import tiny_assets
from tests.engines import make_engine
from tests.oracle import check_mixed_batch, peft_adapter

LOGIT_ATOL = 2e-4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VOCAB_TARGETS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]


def model_dir(name: str):
    return tiny_assets("llama").model_dir if name == "llama" else family_model_dir(name)


def engine(path, adapters: dict, **kw) -> LLMEngine:
    kw.setdefault("lora_embeddings", True)
    return make_engine(path, adapters, block_size=4, max_num_batched_tokens=16, **kw)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 19, 30)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@pytest.mark.slow
def test_embedding_and_head_lora_match_peft_in_a_mixed_batch(family, tmp_path):
    """Llama (untied), Gemma 2 (tied head, scaled embedding), Qwen3: an adapter on the
    vocabulary modules, one on the head only, and the base, in one batch with chunked
    prefill; logits of every position (score) and greedy tokens equal PEFT's."""
    path = model_dir(family)
    adapters = {
        "vocab": peft_adapter(path, tmp_path / "v", VOCAB_TARGETS, r=8, alpha=16, seed=4),
        "head": peft_adapter(path, tmp_path / "h", ["lm_head"], r=16, alpha=16, seed=5),
    }
    eng = engine(path, adapters)
    got = check_mixed_batch(eng, path, adapters, prompts(eng.spec.vocab_size), 12)
    assert got["vocab"] != got[None], "the adapter should change the continuation"


def test_static_decode_path_serves_vocab_lora(tmp_path):
    path = model_dir("llama")
    adapters = {"vocab": peft_adapter(path, tmp_path / "v", VOCAB_TARGETS, r=8, alpha=16, seed=4)}
    requests = [(p, GREEDY, a) for p in prompts(512) for a in (None, "vocab")]
    want = [s.output_ids for s in engine(path, adapters).generate(requests)]
    eng = engine(path, adapters)
    runner = eng.executor
    runner.static_decode = runner.make_static_decode(eng.config.max_num_seqs)
    used, real_run = [], runner.static_decode.run
    runner.static_decode.run = lambda *a: used.append(1) or real_run(*a)
    assert [s.output_ids for s in eng.generate(requests)] == want
    assert used


def test_vocab_lora_is_refused_unless_enabled_and_for_another_vocabulary(tmp_path):
    path = model_dir("llama")
    adapter = peft_adapter(path, tmp_path / "v", VOCAB_TARGETS, r=8, alpha=16, seed=4)
    off = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_bytes=8 << 20))
    with pytest.raises(AdapterFormatError, match="engine.lora_embeddings: true"):
        off.load_adapter("vocab", adapter)
    other = tiny_assets("llama", vocab_size=600).model_dir  # same shapes, another vocabulary
    wide = peft_adapter(other, tmp_path / "w", ["embed_tokens"], r=8, alpha=8, seed=6)
    with pytest.raises(AdapterFormatError, match="vocabulary other than the base model's 512"):
        engine(path, {}).load_adapter("wide", wide)


def test_vocab_lora_memory_is_counted():
    """Each adapter row also holds the vocabulary modules' A and B: fewer adapters fit."""
    from replica.adapters.memory import slot_bytes
    from replica.model.spec import load_model_spec

    spec = load_model_spec(model_dir("llama"))
    extra = slot_bytes(spec, 1, torch.float32, vocab=True) - slot_bytes(spec, 1, torch.float32)
    assert extra == 4 * (2 * spec.vocab_size + 2 * spec.hidden_size)
    budget = 8 << 20
    plain = engine(model_dir("llama"), {}, adapter_memory_bytes=budget, lora_embeddings=False)
    vocab = engine(model_dir("llama"), {}, adapter_memory_bytes=budget)
    assert vocab.config.adapters.num_slots < plain.config.adapters.num_slots
    assert vocab.executor.lora.nbytes() <= budget
