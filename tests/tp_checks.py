"""Tensor parallelism's oracle is TP=1: the check that a 2-rank engine equals a 1-rank one
(logits and a staggered mixed batch), and the prompts and request stream it uses."""

from __future__ import annotations

import torch

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.wire import GenerateRequest, SamplingParams

LOGIT_ATOL = 2e-4  # the bar TP=1 meets against transformers
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(vocab: int, lengths=(5, 23)) -> list[list[int]]:
    """Prompts of `lengths` tokens drawn from [3, vocab), the same on every call."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def staggered(eng: LLMEngine, requests) -> list[list[int]]:
    """One request arrives per step, so prefills share steps with decodes."""
    seqs = []
    for r in requests:
        seqs.append(eng.add_request(GenerateRequest(*r)))
        eng.step()
    for _ in range(1000):
        if not eng.has_work():
            return [s.output_ids for s in seqs]
        eng.step()
    raise AssertionError("engine did not drain")


def check_tp2_equals_tp1(model_dir, adapters: dict, what: str, **engine) -> None:
    """TP=2 against TP=1 on `model_dir` with `adapters` loaded: every adapter's and the
    base's logits on two prompts within LOGIT_ATOL, and a staggered mixed batch's tokens
    equal (`what` names the case in a failure; `engine`: more EngineConfig fields)."""

    def build(tp_size: int) -> LLMEngine:
        cfg = EngineConfig(model=str(model_dir), device="cpu", tp_size=tp_size,
                           kv_cache_bytes=16 << 20, block_size=4, **engine)  # fmt: skip
        eng = LLMEngine(cfg)
        for name, path in adapters.items():
            eng.load_adapter(name, path)
        return eng

    one = build(1)
    two = build(2)
    try:
        ps = prompts(one.spec.vocab_size, (5, 23))
        for adapter in (None, *adapters):
            for p in ps:
                diff = (two.score(p, adapter) - one.score(p, adapter)).abs().max().item()
                assert diff < LOGIT_ATOL, f"{what} {adapter}: max |TP2 - TP1 logit| {diff}"
        names = [None, *adapters, None]
        reqs = [(p, GREEDY, a) for p, a in zip(prompts(one.spec.vocab_size, (3, 17, 30, 9)), names)]
        assert staggered(two, reqs) == staggered(one, reqs)
    finally:
        two.shutdown()
        one.shutdown()
