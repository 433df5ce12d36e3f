"""A mixed continuous batch gives every sequence exactly what it gets alone."""

from __future__ import annotations

import torch

from replica.model.kv_cache import KVCache
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def mixed_requests(assets, vocab: int) -> list[tuple[list[int], SamplingParams, str | None]]:
    g = torch.Generator().manual_seed(7)
    names = [None, *assets.adapters, None, "adapter-01", "adapter-03"]
    lengths = [3, 17, 9, 30, 1, 12, 25, 6]
    return [
        (torch.randint(3, vocab, (n,), generator=g).tolist(), GREEDY, a)
        for n, a in zip(lengths, names)
    ]


def alone(assets, requests) -> list[list[int]]:
    eng = make_engine(assets)
    return [eng.generate([r])[0].output_ids for r in requests]


def test_mixed_batch_equals_each_alone(tiny):
    eng = make_engine(tiny)
    reqs = mixed_requests(tiny, eng.spec.vocab_size)
    together = [s.output_ids for s in eng.generate(reqs)]
    assert together == alone(tiny, reqs)
    assert len({tuple(o) for o in together}) > 4, "adapters should produce distinct outputs"


def test_chunked_prefill_and_staggered_arrivals_equal_alone(tiny):
    # A small token budget splits prompts into chunks that share steps with decodes.
    eng = make_engine(tiny, max_num_batched_tokens=8)
    reqs = mixed_requests(tiny, eng.spec.vocab_size)
    seqs = [eng.add_request(GenerateRequest(*reqs[0]))]
    for r in reqs[1:]:
        eng.step()  # each request arrives while others are mid-flight
        seqs.append(eng.add_request(GenerateRequest(*r)))
    for _ in range(500):
        if not eng.has_work():
            break
        eng.step()
    assert [s.output_ids for s in seqs] == alone(tiny, reqs)


def test_kv_exhaustion_queues_and_preempts_without_failing(tiny):
    # 6 blocks of 4 tokens: one request at a time fits, so others wait or are preempted.
    eng = make_engine(tiny)
    per_block = KVCache.bytes_per_block(eng.spec, 4, eng.dtype)
    eng = make_engine(tiny, block_size=4, kv_cache_bytes=6 * per_block)
    assert eng.max_model_len == 24
    reqs = [(ids[:10], GREEDY, a) for ids, _, a in mixed_requests(tiny, eng.spec.vocab_size)]
    reqs = [r for r in reqs if len(r[0]) + GREEDY.max_tokens <= 24]
    out = [s.output_ids for s in eng.generate(reqs)]
    assert out == alone(tiny, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert eng.scheduler.allocator.num_free == 6
