"""Prefix caching: what a cached prefix serves equals what computing it serves (the cache
off, and transformers + PEFT), a prefix is never a hit under another adapter, the base
model or another version of its adapter, and the blocks' reference counts stay exact
through eviction, preemption, abort and unload."""

from __future__ import annotations

import torch

from replica.engine.engine import LLMEngine
from replica.engine.sequence import Sequence
from replica.model.kv_cache import KVCache
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import make_engine, tokens
from tests.oracle import hf_greedy, hf_model

BS = 4  # small blocks: a 40-token prefix is 10 of them
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


PREFIX = tokens(1, 40)


def engine(tiny, cache: bool = True, **kw) -> LLMEngine:
    return make_engine(tiny, block_size=BS, enable_prefix_caching=cache, **kw)


def run(eng: LLMEngine, requests, max_steps: int = 2000) -> list[Sequence]:
    """The requests as one batch, to completion, checking the block bookkeeping each step."""
    seqs = [eng.add_request(GenerateRequest(ids, sp, adapter)) for ids, sp, adapter in requests]
    for _ in range(max_steps):
        if not eng.has_work():
            break
        eng.step()
        check_blocks(eng)
    assert not eng.has_work()
    return seqs


def check_blocks(eng: LLMEngine) -> None:
    """Allocator invariants, and every reference count equals the tables holding the block."""
    sched = eng.scheduler
    sched.allocator.check()
    held: dict[int, int] = {}
    for seq in sched.running + sched.waiting:
        for b in seq.blocks:
            held[b] = held.get(b, 0) + 1
    for b in range(sched.allocator.num_blocks):
        assert sched.allocator.refs(b) == held.get(b, 0), f"block {b}"


def hit(seq: Sequence) -> int:
    return seq.num_cached_tokens or 0


def full_blocks(prompt: list[int]) -> int:
    """Prompt tokens a hit can cover: whole blocks, its last token left to compute."""
    return (len(prompt) - 1) // BS * BS


def test_shared_prefixes_under_adapters_and_base_equal_uncached_and_transformers_peft(tiny):
    a, b = "adapter-01", "adapter-02"
    waves = [
        [(PREFIX + tokens(10 + i, 5), GREEDY, a) for i in range(2)],  # fills the cache for a
        [  # a mixed batch: a hits, b and the base start cold, then each other's prefixes
            (PREFIX + tokens(20, 7), GREEDY, a),
            (PREFIX + tokens(21, 3), GREEDY, b),
            (PREFIX + tokens(22, 9), GREEDY, None),
            (PREFIX[:23] + tokens(23, 4), GREEDY, a),  # a shorter shared prefix
        ],
        [(PREFIX + tokens(30 + i, 6), GREEDY, m) for i, m in enumerate([b, None, a])],
    ]
    cached, uncached = engine(tiny), engine(tiny, cache=False)
    on = [run(cached, w) for w in waves]
    off = [run(uncached, w) for w in waves]
    assert [[s.output_ids for s in w] for w in on] == [[s.output_ids for s in w] for w in off]

    models: dict = {}
    for wave, seqs in zip(waves, on):
        for (prompt, sp, adapter), seq in zip(wave, seqs):
            if adapter not in models:
                models[adapter] = hf_model(tiny.model_dir, adapter and tiny.adapters[adapter])
            assert seq.output_ids == hf_greedy(models[adapter], prompt, sp.max_tokens)

    assert [hit(s) for s in on[0]] == [0, 0]  # admitted in one step: neither is cached yet
    assert [hit(s) for s in on[1]] == [40, 0, 0, 20]
    assert [hit(s) for s in on[2]] == [40, 40, 40]
    assert all(hit(s) == 0 for w in off for s in w)
    assert cached.scheduler.prefix.hit_tokens == sum(hit(s) for w in on for s in w)


def test_a_prefix_is_a_hit_only_under_the_adapter_version_that_computed_it(tiny):
    eng = engine(tiny)
    prompt = PREFIX + tokens(5, 3)
    first = run(eng, [(prompt, GREEDY, "adapter-01")])[0]
    others = run(eng, [(prompt, GREEDY, "adapter-02"), (prompt, GREEDY, None)])
    again = run(eng, [(prompt, GREEDY, "adapter-01")])[0]
    assert hit(first) == 0 and [hit(s) for s in others] == [0, 0]
    assert hit(again) == full_blocks(prompt)
    assert again.output_ids == first.output_ids


def test_a_name_registered_again_with_other_weights_serves_the_new_weights(tiny):
    eng = engine(tiny)
    prompt = PREFIX + tokens(6, 3)
    eng.load_adapter("customer", tiny.adapters["adapter-01"])
    old = run(eng, [(prompt, GREEDY, "customer")])[0]
    cached_before = eng.scheduler.allocator.num_cached
    eng.unload_adapter("customer")
    assert eng.scheduler.allocator.num_cached < cached_before  # its blocks went at once
    eng.load_adapter("customer", tiny.adapters["adapter-02"])
    new = run(eng, [(prompt, GREEDY, "customer")])[0]
    want = run(engine(tiny, cache=False), [(prompt, GREEDY, "adapter-02")])[0].output_ids
    assert hit(new) == 0
    assert new.output_ids == want != old.output_ids


def test_loading_a_name_anew_drops_its_cached_prefixes(tiny):
    eng = engine(tiny)
    prompt = PREFIX + tokens(7, 3)
    eng.load_adapter("customer", tiny.adapters["adapter-01"])
    run(eng, [(prompt, GREEDY, "customer")])
    eng.unload_adapter("customer")  # a live name is refused: unload, then load anew
    eng.load_adapter("customer", tiny.adapters["adapter-03"])
    new = run(eng, [(prompt, GREEDY, "customer")])[0]
    assert hit(new) == 0


def test_eviction_under_kv_pressure_keeps_outputs_and_counts_exact(tiny):
    # 24 blocks: each request needs 13 (48 + 6 tokens), so every admission evicts cached
    # blocks of earlier prefixes; then an earlier prefix comes back and computes again
    per_block = KVCache.bytes_per_block(make_engine(tiny).spec, BS, torch.float32)
    kw = {"kv_cache_bytes": 24 * per_block}
    prefixes = [tokens(40 + i, 44) for i in range(4)]
    waves = [[(p + tokens(50 + i, 4), GREEDY, "adapter-03")] for i, p in enumerate(prefixes)]
    waves.append([(prefixes[0] + tokens(60, 4), GREEDY, "adapter-03")])
    eng = engine(tiny, **kw)
    on = [run(eng, w)[0] for w in waves]
    off = [run(engine(tiny, cache=False, **kw), w)[0] for w in waves]
    assert [s.output_ids for s in on] == [s.output_ids for s in off]
    assert hit(on[-1]) < 44  # its prefix was evicted (partly at least)
    alloc = eng.scheduler.allocator
    assert alloc.num_free == alloc.num_blocks and alloc.num_cached > 0


def test_preemption_recomputes_from_what_stayed_cached(tiny):
    # 18 blocks for 4 requests of 40 + 16 tokens sharing their first 32: decodes outgrow
    # the cache and the youngest are preempted, then readmitted on the cached prefix
    per_block = KVCache.bytes_per_block(make_engine(tiny).spec, BS, torch.float32)
    kw = {"kv_cache_bytes": 18 * per_block}
    sp = GREEDY.model_copy(update={"max_tokens": 16})
    reqs = [(PREFIX[:32] + tokens(70 + i, 8), sp, "adapter-00") for i in range(4)]
    eng = engine(tiny, **kw)
    on = run(eng, reqs)
    off = run(engine(tiny, cache=False, **kw), reqs)
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_ids for s in on] == [s.output_ids for s in off]
    # readmissions looked up again: more hit tokens than the first admissions found
    assert eng.scheduler.prefix.hit_tokens > sum(hit(s) for s in on)
    alloc = eng.scheduler.allocator
    assert alloc.num_free == alloc.num_blocks


def test_abort_and_n_choices_release_shared_blocks_exactly(tiny):
    eng = engine(tiny)
    sp = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    keep = eng.add_request(GenerateRequest(PREFIX + tokens(80, 2), sp, "adapter-01"))
    gone = eng.add_request(GenerateRequest(PREFIX + tokens(81, 2), GREEDY, "adapter-01"))
    for _ in range(3):
        eng.step()
        check_blocks(eng)
    shared = keep.blocks[0]
    assert eng.scheduler.allocator.refs(shared) >= 3  # the forks share the full blocks
    eng.abort(gone)
    check_blocks(eng)
    for _ in range(100):
        if not eng.has_work():
            break
        eng.step()
        check_blocks(eng)
    assert all(len(c.output_ids) == 8 for c in keep.choices)
    alloc = eng.scheduler.allocator
    assert alloc.num_free == alloc.num_blocks


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny):
    eng = engine(tiny)
    prompt = PREFIX + tokens(90, 3)
    run(eng, [(prompt, GREEDY, None)])
    scored = run(eng, [(prompt, GREEDY.model_copy(update={"prompt_logprobs": 1}), None)])[0]
    assert hit(scored) == 0 and len(scored.group.prompt_logprobs) == len(prompt)


def test_the_cache_off_caches_nothing(tiny):
    eng = engine(tiny, cache=False)
    run(eng, [(PREFIX, GREEDY, None), (PREFIX, GREEDY, None)])
    assert eng.scheduler.allocator.num_cached == 0
    assert eng.drain_telemetry()["prefix_queried_tokens"] == 0
