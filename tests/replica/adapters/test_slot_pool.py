"""Slot pool and eviction policies, with plain strings: check_integrity after every operation."""

from __future__ import annotations

import pytest

from replica.adapters.eviction import FIFOPolicy, LRUPolicy, make_policy
from replica.adapters.slot_pool import AdapterSlotPool, SlotState


def test_lru_and_fifo_pick_different_victims():
    for policy, expected in ((LRUPolicy(), "b"), (FIFOPolicy(), "a")):
        for name in "abc":
            policy.insert(name)
        policy.touch("a")  # used again: LRU keeps it, FIFO does not care
        assert policy.select_victim({"a", "b", "c"}) == expected
        assert policy.select_victim({"c"}) == "c"
        assert policy.select_victim(set()) is None
    with pytest.raises(ValueError, match="expected one of lru, fifo"):
        make_policy("random")


def ready(pool: AdapterSlotPool, name: str) -> int:
    slot = pool.reserve(name)
    assert slot is not None
    pool.mark_ready(slot)
    pool.check_integrity()
    return slot


def test_base_slot_is_pinned_and_never_handed_out():
    pool = AdapterSlotPool(3, LRUPolicy())
    slots = {ready(pool, "a"), ready(pool, "b")}
    assert slots == {1, 2}
    for i in range(10):  # churn: every reserve evicts, never slot 0
        slot = ready(pool, f"x{i}")
        assert slot != 0
        assert pool.slots[0].state is SlotState.READY and pool.slots[0].pinned
    assert pool.num_evictions == 10


def test_referenced_and_loading_slots_are_never_evicted():
    pool = AdapterSlotPool(3, LRUPolicy())
    a = ready(pool, "a")
    pool.acquire(a)
    b = pool.reserve("b")  # LOADING
    assert pool.reserve("c") is None  # a is referenced, b is in flight
    pool.mark_ready(b)
    assert pool.reserve("c", protected={"b"}) is None  # b is wanted by a waiting request
    c = pool.reserve("c")
    assert c == b and pool.state("b") is None
    pool.release(a)
    pool.check_integrity()
    assert not pool.evict("c")  # still loading
    pool.mark_ready(c)
    assert pool.evict("c") and pool.state("c") is None
    pool.check_integrity()


def test_failed_load_frees_the_slot():
    pool = AdapterSlotPool(2, LRUPolicy())
    slot = pool.reserve("a")
    pool.cancel(slot)
    pool.check_integrity()
    assert pool.num_free == 1 and pool.state("a") is None


def test_free_slots_are_placed_by_rank_class():
    """Adapters of one rank class land in adjacent slots whatever their arrival order, so
    the CPU LoRA ops read each class as one run; unknown ranks take the first free slot."""
    pool = AdapterSlotPool(17, LRUPolicy(), max_rank=64)
    ranks = [8, 16, 32, 64] * 4  # the order the demo adapters arrive in
    placed: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        slot = pool.reserve(f"a{i}", rank=r)
        pool.check_integrity()
        placed.setdefault(r, []).append(slot)
    for lo, r in zip((1, 5, 9, 13), (8, 16, 32, 64)):
        assert sorted(placed[r]) == list(range(lo, lo + 4))
    other = AdapterSlotPool(5, LRUPolicy(), max_rank=64)
    assert other.reserve("x", rank=None) == 1
    assert other.reserve("y", rank=64) == 4
    assert other.reserve("z", rank=4) == 2  # below the smallest class: with rank 8
