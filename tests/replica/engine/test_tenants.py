"""Tenants in the engine (tiny model): under VTC a tenant's requests are admitted within a
bounded number of steps of another tenant's flood (under FCFS they wait for all of it),
and the prefix cache never serves one tenant's prompt to another, nor across cache_salts."""

from __future__ import annotations

import pytest

from replica.engine.engine import LLMEngine
from replica.engine.kv_blocks import BASE_IDENTITY, root_key
from replica.engine.sequence import SeqStatus, Sequence
from replica.wire import GenerateRequest, SamplingParams, cache_scope
from tests.engines import make_engine, tokens

SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def steps_until_admitted(eng: LLMEngine, seqs: list[Sequence], limit: int = 200) -> int:
    for step in range(1, limit + 1):
        eng.step()
        if all(s.status is not SeqStatus.WAITING for s in seqs):
            return step
    return limit


@pytest.mark.parametrize("scheduling", ["vtc", "fcfs"])
def test_a_flood_from_one_tenant_does_not_hold_back_another(tiny, scheduling):
    eng = make_engine(tiny, scheduling=scheduling, max_num_seqs=4)
    for i in range(32):  # tenant a floods: eight times the batch
        eng.add_request(GenerateRequest(tokens(i, 12), SHORT, "adapter-01", tenant="a"))
    eng.step()  # a fills the batch; the rest of its flood waits
    b = [
        eng.add_request(GenerateRequest(tokens(100 + i, 12), SHORT, "adapter-02", tenant="b"))
        for i in range(2)
    ]
    waited = steps_until_admitted(eng, b)
    # a seat frees every max_tokens steps; b takes the first ones (a's head goes first
    # on a tie of counters, so b may wait for one more)
    if scheduling == "vtc":
        assert waited <= 2 * SHORT.max_tokens + 1
        assert eng.residency()["tenant_counters"]["b"] > 0
    else:  # fcfs: b waits behind all 32 of a's
        assert waited > 6 * SHORT.max_tokens
        assert eng.residency()["tenant_counters"] == {}


# -- cache isolation --------------------------------------------------------------------------

PROMPT = tokens(7, 40)  # ten blocks of 4


def cached(eng: LLMEngine, tenant: str | None, salt: str | None = None, prompt=PROMPT) -> int:
    seq = eng.add_request(GenerateRequest(prompt, SHORT, None, tenant=tenant, cache_salt=salt))
    while eng.has_work():
        eng.step()
    return seq.num_cached_tokens


def test_a_tenant_never_hits_another_tenants_prefix_and_salts_partition_within_one(tiny):
    eng = make_engine(tiny, block_size=4, enable_prefix_caching=True)
    full = (len(PROMPT) - 1) // 4 * 4
    assert cached(eng, "a") == 0
    assert cached(eng, "b") == 0  # the same prompt on the base model: not a's
    assert cached(eng, "a") == full  # a's own second request hits
    assert cached(eng, None) == 0  # no tenant (admin) is a partition of its own
    assert cached(eng, "a", salt="s1") == 0  # a salt splits a's cache
    assert cached(eng, "a", salt="s1") == full
    assert cached(eng, "a", salt="s2") == 0
    assert cached(eng, "b", salt="s1") == 0  # the same salt under another tenant


def test_without_tenant_or_salt_the_keys_are_the_ones_before_tenants():
    import hashlib

    assert cache_scope(None, None) == ""
    assert root_key("adapter#3", "") == hashlib.sha256(b"lorafleet-prefix\0adapter#3").digest()
    roots = {
        root_key(BASE_IDENTITY, cache_scope(t, s))
        for t, s in [(None, None), ("a", None), (None, "a"), ("a", "a"), ("b", None)]
    }
    assert len(roots) == 5  # tenant and salt are never confused with each other
