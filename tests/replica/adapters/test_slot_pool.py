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
        assert policy.eviction_order({"a", "b", "c"})[0] == expected
    with pytest.raises(ValueError, match="expected one of lru, fifo"):
        make_policy("random")


def ready(pool: AdapterSlotPool, name: str, rank: int | None = None) -> int:
    slot = pool.reserve(name, rank=rank)
    assert slot is not None
    pool.mark_ready(slot)
    pool.check_integrity()
    return slot


def test_base_slot_is_pinned_and_never_handed_out():
    pool = AdapterSlotPool(3, LRUPolicy())
    slots = {ready(pool, "a"), ready(pool, "b")}  # unknown rank: a max-rank block each
    assert slots == {1, 2}
    for i in range(10):  # churn: every reserve evicts, never slot 0
        slot = ready(pool, f"x{i}")
        assert slot != 0
        assert pool.slots[0].state is SlotState.READY and pool.slots[0].pinned
    assert pool.num_evictions == 10 and pool.slots[0].rows == 0


def test_referenced_and_loading_slots_are_never_evicted():
    pool = AdapterSlotPool(3, LRUPolicy())
    a = ready(pool, "a")
    pool.acquire(a)
    b = pool.reserve("b")  # LOADING
    assert pool.reserve("c") is None  # a is referenced, b is in flight
    pool.mark_ready(b)
    assert pool.reserve("c", protected={"b"}) is None  # b is wanted by a waiting request
    rows_b = pool.slots[b].row0
    c = pool.reserve("c")
    assert pool.slots[c].row0 == rows_b and pool.state("b") is None
    pool.release(a)
    pool.check_integrity()
    assert not pool.evict("c")  # still loading
    pool.mark_ready(c)
    assert pool.evict("c") and pool.state("c") is None
    pool.check_integrity()


def test_failed_load_frees_the_slot():
    pool = AdapterSlotPool(2, LRUPolicy())
    slot = pool.reserve("a")
    assert pool.num_free == 0
    pool.cancel(slot)
    pool.check_integrity()
    assert pool.num_free == 1 and pool.state("a") is None and pool.rows_used == 0


def test_adapters_hold_their_rank_in_aligned_blocks_packed_tight():
    """A rank-r adapter holds the next power of two of rows (at least 8) at an offset
    aligned to it; best fit packs mixed ranks into as few 64-row blocks as their rows
    need, so the rest stay whole for rank-64 adapters."""
    pool = AdapterSlotPool(17, LRUPolicy(), max_rank=64)  # 16 blocks of 64 rows
    ranks = [8, 16, 32, 64] * 4 + [4, 12]  # the order the demo adapters arrive in
    for i, r in enumerate(ranks):
        slot = pool.slots[pool.reserve(f"a{i}", rank=r)]
        pool.check_integrity()
        assert slot.rows == {4: 8, 12: 16}.get(r, r) and slot.row0 % slot.rows == 0
    assert pool.rows_used == 4 * (8 + 16 + 32 + 64) + 8 + 16 == 504
    assert pool.num_free == 16 - 8  # 504 rows in 8 blocks of 64: no block half used
    assert pool.occupancy() == {"free": 8, "loading": 18, "ready": 0}


def test_a_large_adapter_evicts_the_cheapest_aligned_region():
    """No free block of 64 rows: the policy's order decides which aligned region goes,
    the one whose most recently used occupant is oldest; referenced, loading and
    protected adapters keep their region."""
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64)  # two blocks of 64 rows
    small = [ready(pool, f"s{i}", rank=8) for i in range(8)]  # block 0, all of it
    assert pool.slots[ready(pool, "big", rank=64)].row0 == 64  # block 1
    assert pool.num_free == 0
    for s in small:  # the small ones were used since: big is the cheapest region
        pool.acquire(s)
        pool.release(s)
    new = pool.reserve("new", rank=64)
    assert pool.state("big") is None and pool.slots[new].row0 == 64
    assert all(pool.state(f"s{i}") is SlotState.READY for i in range(8))
    assert pool.num_evictions == 1
    pool.mark_ready(new)
    pool.acquire(new)  # referenced: block 1 stays, so all eight small ones go together
    again = pool.reserve("again", rank=64)
    assert pool.slots[again].row0 == 0 and pool.num_evictions == 9
    pool.check_integrity()
    pool.mark_ready(again)
    # rank 8 fits into neither block now: one referenced, one protected
    assert pool.reserve("tiny", protected={"again"}, rank=8) is None
    pool.check_integrity()


def test_hand_over_keeps_the_whole_block_and_needs_it_to_fit():
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64)
    a = ready(pool, "a", rank=16)
    assert pool.slots[a].rows == 16
    assert pool.fits(a, 16) and pool.fits(a, 9) and not pool.fits(a, 32)
    pool.hand_over("b", a)
    assert pool.state("a") is None and pool.state("b") is SlotState.LOADING
    assert pool.slots[a].rows == 16 and pool.rows_used == 16
    pool.check_integrity()
