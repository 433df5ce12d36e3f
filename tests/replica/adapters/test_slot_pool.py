"""Slot pool and eviction policies, with plain strings: check_integrity after every operation."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.adapters.slot_pool import (
    AdapterSlotPool,
    FIFOPolicy,
    LRUPolicy,
    SlotState,
    make_policy,
)


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


def r(rank: int) -> dict[str, int]:
    """The ranks of an adapter of `rank` in a one-group pool (plain names, one arena)."""
    return {"lora": rank}


MAX = r(64)  # max_lora_rank in a one-group pool


def ready(pool: AdapterSlotPool, name: str, ranks: Mapping[str, int] = MAX) -> int:
    slot = pool.reserve(name, ranks)
    assert slot is not None
    pool.mark_ready(slot)
    pool.check_integrity()
    return slot


def test_base_slot_is_pinned_and_never_handed_out():
    pool = AdapterSlotPool(3, LRUPolicy())
    slots = {ready(pool, "a"), ready(pool, "b")}  # a max-rank block each
    assert slots == {1, 2}
    for i in range(10):  # churn: every reserve evicts, never slot 0
        slot = ready(pool, f"x{i}")
        assert slot != 0
        assert pool.slots[0].state is SlotState.READY and pool.slots[0].pinned
    assert pool.num_evictions == 10 and not pool.slots[0].blocks


def test_referenced_and_loading_slots_are_never_evicted():
    pool = AdapterSlotPool(3, LRUPolicy())
    a = ready(pool, "a")
    pool.acquire(a)
    b = pool.reserve("b", MAX)  # LOADING
    assert pool.reserve("c", MAX) is None  # a is referenced, b is in flight
    pool.mark_ready(b)
    assert pool.reserve("c", MAX, protected={"b"}) is None  # wanted by a waiting request
    rows_b = pool.slots[b].blocks
    c = pool.reserve("c", MAX)
    assert pool.slots[c].blocks == rows_b and pool.state("b") is None
    pool.release(a)
    pool.check_integrity()
    assert not pool.evict("c")  # still loading
    pool.mark_ready(c)
    assert pool.evict("c") and pool.state("c") is None
    pool.check_integrity()


def test_failed_load_frees_the_slot():
    pool = AdapterSlotPool(2, LRUPolicy())
    slot = pool.reserve("a", MAX)
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
    for i, rank in enumerate(ranks):
        slot = pool.slots[pool.reserve(f"a{i}", {"lora": rank})]
        pool.check_integrity()
        (row0, rows), *_ = slot.blocks.values()
        assert rows == {4: 8, 12: 16}.get(rank, rank) and row0 % rows == 0
    assert pool.rows_used == 4 * (8 + 16 + 32 + 64) + 8 + 16 == 504
    assert pool.num_free == 16 - 8  # 504 rows in 8 blocks of 64: no block half used
    assert pool.occupancy() == {"free": 8, "loading": 18, "ready": 0}


def test_a_large_adapter_evicts_the_cheapest_aligned_region():
    """No free block of 64 rows: the policy's order decides which aligned region goes,
    the one whose most recently used occupant is oldest; referenced, loading and
    protected adapters keep their region."""
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64)  # two blocks of 64 rows
    small = [ready(pool, f"s{i}", r(8)) for i in range(8)]  # block 0, all of it
    assert pool.slots[ready(pool, "big", MAX)].offsets == {"lora": 64}  # block 1
    assert pool.num_free == 0
    for s in small:  # the small ones were used since: big is the cheapest region
        pool.acquire(s)
        pool.release(s)
    new = pool.reserve("new", MAX)
    assert pool.state("big") is None and pool.slots[new].offsets == {"lora": 64}
    assert all(pool.state(f"s{i}") is SlotState.READY for i in range(8))
    assert pool.num_evictions == 1
    pool.mark_ready(new)
    pool.acquire(new)  # referenced: block 1 stays, so all eight small ones go together
    again = pool.reserve("again", MAX)
    assert pool.slots[again].offsets == {"lora": 0} and pool.num_evictions == 9
    pool.check_integrity()
    pool.mark_ready(again)
    # rank 8 fits into neither block now: one referenced, one protected
    assert pool.reserve("tiny", r(8), protected={"again"}) is None
    pool.check_integrity()


def test_hand_over_keeps_the_whole_block_until_the_load_lands_then_trims_it():
    """The running step still reads the slot's rows, so a hand-over keeps its blocks
    whole (one too small for the new ranks rules the slot out); once the new adapter's
    load has landed, trim keeps just the rows its ranks need, and the rest are whole
    aligned free blocks again."""
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64)
    a = ready(pool, "a", r(16))
    assert pool.slots[a].rows == 16
    assert pool.holds(a, r(16)) and pool.holds(a, r(9)) and not pool.holds(a, r(8))
    assert not pool.can_hand_over(a, r(32))
    with pytest.raises(ValueError, match="cannot hold 'b'"):
        pool.hand_over("b", a, r(32))
    pool.hand_over("b", a, r(8))
    assert pool.state("a") is None and pool.state("b") is SlotState.LOADING
    assert pool.slots[a].rows == 16 and pool.rows_used == 16  # whole while the step runs
    pool.check_integrity()
    pool.trim(a, r(8))
    pool.check_integrity()
    assert pool.holds(a, r(8)) and pool.rows_used == 8
    assert pool.slots[ready(pool, "c", r(8))].offsets == {"lora": 8}  # the rows given back


def test_hand_over_takes_a_free_block_in_a_group_the_slot_holds_no_rows_of():
    """A q/v adapter's slot handed to an adapter of every module: its qkv_proj block is
    kept whole and the other groups get free blocks (rows no running sequence reads); a
    group whose block is too small, or with no free block, rules the slot out."""
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64, groups=GROUPS)
    qv = ready(pool, "qv", {"qkv_proj": 64})
    ready(pool, "mlp", {"gate_up_proj": 64, "down_proj": 64})
    assert pool.can_hand_over(qv, {"qkv_proj": 64, "o_proj": 64, "down_proj": 64})
    assert not pool.can_hand_over(qv, {"o_proj": 64, "down_proj": 128})
    pool.hand_over("all", qv, dict.fromkeys(GROUPS, 64))
    assert pool.slots[qv].offsets == {
        "qkv_proj": 0, "o_proj": 0, "gate_up_proj": 64, "down_proj": 64,
    }  # fmt: skip
    pool.check_integrity()
    pool.mark_ready(qv)
    assert not pool.can_hand_over(qv, {"o_proj": 128})
    ready(pool, "qv2", {"qkv_proj": 64})
    mlp = pool.ready_slot("mlp")
    assert not pool.can_hand_over(mlp, {"qkv_proj": 8})  # qkv_proj is full


GROUPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_an_adapter_holds_its_own_rank_in_each_group_and_none_where_it_targets_nothing():
    """One arena per projection group: a rank_pattern adapter (rank-64 attention, rank-8
    MLP) holds 64 rows of the attention arenas and 8 of the MLP's; a q/v adapter holds
    rows of qkv_proj only, so an MLP adapter of max rank fits beside it in memory sized
    for one max-rank adapter."""
    pool = AdapterSlotPool(2, LRUPolicy(), max_rank=64, groups=GROUPS)  # 64 rows a group
    mixed = {"qkv_proj": 64, "o_proj": 64, "gate_up_proj": 8, "down_proj": 8}
    m = ready(pool, "mixed", mixed)
    assert {g: rows for g, (_, rows) in pool.slots[m].blocks.items()} == mixed
    assert pool.evict("mixed")
    qv = ready(pool, "qv", {"qkv_proj": 64})
    mlp = ready(pool, "mlp", {"gate_up_proj": 64, "down_proj": 64, "qkv_proj": 0})
    assert set(pool.slots[qv].blocks) == {"qkv_proj"}
    assert set(pool.slots[mlp].blocks) == {"gate_up_proj", "down_proj"}
    assert pool.num_evictions == 0 and pool.rows_used == 3 * 64
    assert pool.num_free == 0  # qkv_proj, gate_up_proj and down_proj have no whole block
    # o_proj alone is free: an o_proj adapter evicts no one, one more q/v adapter evicts qv
    ready(pool, "o", {"o_proj": 64})
    ready(pool, "qv2", {"qkv_proj": 64})
    assert pool.state("qv") is None and pool.state("mlp") is SlotState.READY
    assert pool.num_evictions == 1
    with pytest.raises(ValueError, match="groups \\['lm_head'\\]"):
        pool.reserve("x", {"lm_head": 8})


def test_evicting_for_one_group_frees_the_victims_rows_in_every_group():
    pool = AdapterSlotPool(2, LRUPolicy(), max_rank=64, groups=GROUPS)
    ready(pool, "all", dict.fromkeys(GROUPS, 64))  # 64 rows in every group
    ready(pool, "none", {})  # no ranks (the unpinned base): a handle, no rows
    new = ready(pool, "attn", {"qkv_proj": 32, "o_proj": 32})
    assert pool.state("all") is None and pool.state("none") is SlotState.READY
    assert pool.rows_used == 64 and pool.arenas["down_proj"].rows_used == 0
    assert pool.slots[new].offsets == {"qkv_proj": 0, "o_proj": 0}


def test_a_load_that_cannot_be_placed_evicts_no_one():
    """qkv_proj's only region holds a referenced adapter: a load needing qkv_proj rows
    fails without evicting the idle MLP adapter first (evictions only free rows, so
    whether each group can be placed is known before any eviction)."""
    pool = AdapterSlotPool(2, LRUPolicy(), max_rank=64, groups=GROUPS)
    busy = ready(pool, "busy", {"qkv_proj": 64})
    pool.acquire(busy)
    ready(pool, "idle", {"gate_up_proj": 64, "down_proj": 64})
    assert pool.reserve("both", {"qkv_proj": 8, "down_proj": 64}) is None
    assert pool.state("idle") is SlotState.READY and pool.num_evictions == 0
    pool.check_integrity()


def test_a_reservation_holds_exactly_each_groups_own_rank_from_the_start():
    """The ranks per group are known before the weights (computed at conversion): a
    reservation takes each group's own block and none in a group the adapter does not
    target, and the rows it leaves are whole aligned blocks for the next."""
    pool = AdapterSlotPool(2, LRUPolicy(), max_rank=64, groups=GROUPS)
    exact = {"qkv_proj": 64, "o_proj": 16, "gate_up_proj": 0, "down_proj": 8}
    slot = pool.reserve("a", exact)
    pool.check_integrity()
    blocks = pool.slots[slot].blocks
    assert blocks == {"qkv_proj": (0, 64), "o_proj": (0, 16), "down_proj": (0, 8)}
    assert pool.holds(slot, exact) and not pool.holds(slot, dict.fromkeys(GROUPS, 64))
    assert not pool.holds(slot, {**exact, "gate_up_proj": 8})
    assert not pool.holds(slot, {**exact, "o_proj": 32})
    pool.mark_ready(slot)
    b = ready(pool, "b", {"o_proj": 32, "down_proj": 32, "gate_up_proj": 64})
    assert pool.slots[b].offsets == {"o_proj": 32, "down_proj": 32, "gate_up_proj": 0}
    assert pool.num_evictions == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["reserve", "ready", "acquire", "release", "evict", "cancel", "hand_over"]
            ),
            st.integers(0, 11),  # adapter name
            st.dictionaries(st.sampled_from(GROUPS), st.sampled_from([0, 1, 8, 12, 32, 64])),
        ),
        max_size=60,
    )
)
def test_any_sequence_of_operations_keeps_slots_and_every_groups_rows_consistent(ops):
    """Slots, names and each group's arena rows agree after every operation, and every
    adapter's slot holds exactly its ranks' blocks: from its reservation on, or, handed
    over from a slot whose step ended, once its load has landed (trimmed)."""
    pool = AdapterSlotPool(3, LRUPolicy(), max_rank=64, groups=GROUPS)
    given: dict[str, dict[str, int]] = {}  # each adapter's ranks, as it was placed
    handed: set[str] = set()  # handed over, its load not landed yet
    for op, n, ranks in ops:
        name = f"a{n}"
        i = pool._by_name.get(name)
        slot = None if i is None else pool.slots[i]
        if op == "reserve" and slot is None:
            if pool.reserve(name, ranks) is not None:
                given[name] = ranks
        elif op == "hand_over" and slot is None:
            # a slot whose sequences all ended with the step (their refs released)
            ending = [s.index for s in pool.slots[1:] if s.state is SlotState.READY and not s.refs]
            fitting = [j for j in ending if pool.can_hand_over(j, ranks)]
            if fitting:
                pool.hand_over(name, fitting[0], ranks)
                given[name] = ranks
                handed.add(name)
        elif slot is not None and slot.state is SlotState.LOADING:
            if op == "ready":
                if name in handed:
                    pool.trim(i, given[name])
                pool.mark_ready(i)
                handed.discard(name)
            elif op == "cancel":
                pool.cancel(i)
                handed.discard(name)
        elif slot is not None and op == "acquire":
            pool.acquire(i)
        elif slot is not None and op == "release" and slot.refs:
            pool.release(i)
        elif op == "evict":
            assert pool.evict(name) or slot.refs
        pool.check_integrity()
        for held, j in pool._by_name.items():
            assert held in handed or pool.holds(j, given[held]), (held, pool.slots[j])
