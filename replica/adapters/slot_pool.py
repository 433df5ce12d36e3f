"""Which adapter lives in which slot and which arena rows: states, references, eviction.

Host-only bookkeeping over LoRASlotBuffers. A slot is a handle (an index into the
per-slot rank/scaling/offset tables the kernels read); the weights live in arena rows,
one arena per projection group (qkv_proj, o_proj, ...; replica/adapters/arena.py), and
in each the adapter holds a block sized by its own rank there: a rank-8 adapter holds an
eighth of what a rank-64 one does, a rank_pattern adapter with rank-64 attention and a
rank-8 MLP holds 64 rows of the attention arenas and 8 of the MLP's, and a q/v adapter
holds no rows of the MLP arenas. An adapter's rank per group is known before its weights
are fetched (computed once at conversion, wire.AdapterInfo.ranks), so a reservation
takes exactly the blocks they need. A slot handed over while its sequences run their last
step keeps its blocks until the new adapter's load lands (that step still reads them),
then keeps only what the new ranks need (trim).
Index ranges:
  slot 0          the base model: pinned, always READY, holds no rows, never evicted
  slots 1..S-1    adapters: FREE -> LOADING (a copy is in flight) -> READY -> (evicted) FREE
An adapter may be evicted only when READY, unreferenced (no sequence in the running
batch uses it) and unpinned; LOADING slots are never touched. When some group has no
free block that fits, the policy picks that group's aligned region whose occupants are
cheapest to evict (evicting frees their rows in every group).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from replica.adapters.arena import RowArena
from replica.model.lora_slots import arena_rows, block_rows, num_slot_handles

ONE_GROUP = ("lora",)  # a pool with a single arena (the slot-pool tests use plain names)


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    adapter: str | None = None
    state: SlotState = SlotState.FREE
    refs: int = 0  # sequences in the running batch using this slot
    pinned: bool = False
    used: bool = False  # some sequence ran on this load of the slot (a useful prefetch)
    # per projection group holding rows: (first arena row, block rows = block_rows(rank))
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def offsets(self) -> dict[str, int]:
        """The first arena row of each group's block (what the slot buffers write at)."""
        return {g: row0 for g, (row0, _) in self.blocks.items()}

    @property
    def rows(self) -> int:
        """Arena rows held, summed over groups."""
        return sum(rows for _, rows in self.blocks.values())


class AdapterSlotPool:
    def __init__(
        self,
        num_slots: int,
        policy: EvictionPolicy,
        max_rank: int = 64,
        groups: tuple[str, ...] = ONE_GROUP,
    ) -> None:
        """Room for num_slots - 1 adapters of max_rank in every group of `groups` (more of
        lower ranks, or targeting fewer groups): one arena of rows per group."""
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2: slot 0 is the base model, adapters need one")
        rows = arena_rows(num_slots, max_rank)
        self.arenas = {g: RowArena(rows, max_rank) for g in groups}
        self.num_rows = rows  # of each group's arena
        self.max_rank_adapters = num_slots - 1
        self.slots = [Slot(i) for i in range(num_slot_handles(rows))]
        self.slots[0] = Slot(0, None, SlotState.READY, pinned=True)
        self.policy, self.max_rank = policy, max_rank
        self._by_name: dict[str, int] = {}
        self._free_handles = list(range(len(self.slots) - 1, 0, -1))  # pop() -> lowest
        self.num_evictions = 0
        self.num_used_loads = 0  # loads that some sequence ran on before they were evicted

    # -- queries -------------------------------------------------------------------------------

    def ready_slot(self, name: str) -> int | None:
        """The slot holding `name`, if its weights are fully in place."""
        i = self._by_name.get(name)
        return i if i is not None and self.slots[i].state is SlotState.READY else None

    def state(self, name: str) -> SlotState | None:
        i = self._by_name.get(name)
        return None if i is None else self.slots[i].state

    @property
    def num_free(self) -> int:
        """Loads of any rank that evict no one: whole free blocks of max_lora_rank in the
        fullest group's arena."""
        return min(arena.free_top_blocks() for arena in self.arenas.values())

    @property
    def rows_used(self) -> int:
        """Arena rows held by adapters (loading or ready), summed over the groups' arenas."""
        return sum(arena.rows_used for arena in self.arenas.values())

    def occupancy(self) -> dict[str, int]:
        """Adapters (slot 0 aside) by state, and free as num_free."""
        counts = {state.value: 0 for state in SlotState}
        for i in self._by_name.values():
            counts[self.slots[i].state.value] += 1
        counts[SlotState.FREE.value] = self.num_free
        return counts

    def block_sizes(self, ranks: Mapping[str, int]) -> dict[str, int]:
        """The rows an adapter of `ranks` (rank per projection group; a group left out: 0)
        needs in each group (groups needing none left out)."""
        unknown = set(ranks) - set(self.arenas)
        if unknown:
            raise ValueError(
                f"ranks for groups {sorted(unknown)}: the pool has {list(self.arenas)}"
            )
        sizes = {g: block_rows(r) for g, r in ranks.items()}
        return {g: n for g, n in sizes.items() if n}

    # -- transitions ---------------------------------------------------------------------------

    def reserve(
        self, name: str, ranks: Mapping[str, int], protected: set[str] = frozenset()
    ) -> int | None:
        """A slot and exactly the rows `name`'s `ranks` need, to be loaded into (marked
        LOADING), evicting if needed; None when nothing can be evicted. Adapters in
        `protected` (wanted by requests about to run) are not evicted."""
        if name in self._by_name:
            raise ValueError(f"adapter {name!r} already has slot {self._by_name[name]}")
        sizes = self.block_sizes(ranks)
        if not self._can_place(sizes, protected):
            return None
        if not self._free_handles and not self._evict_one(protected):
            return None
        starts = self._blocks_for(sizes, protected)
        slot = self.slots[self._free_handles.pop()]
        for g, size in sizes.items():
            self.arenas[g].take(starts[g], size, slot.index)
            slot.blocks[g] = (starts[g], size)
        self._claim(slot, name)
        return slot.index

    def holds(self, index: int, ranks: Mapping[str, int]) -> bool:
        """Whether slot `index`'s blocks are exactly those `ranks` need."""
        blocks = self.slots[index].blocks
        return {g: rows for g, (_, rows) in blocks.items()} == self.block_sizes(ranks)

    def can_hand_over(self, index: int, ranks: Mapping[str, int]) -> bool:
        """Whether an adapter of `ranks` can be handed slot `index`: each group's block is
        large enough, or, in a group where the slot holds no rows, a free block is."""
        blocks = self.slots[index].blocks
        return all(
            size <= blocks[g][1] if g in blocks else self.arenas[g].find_free(size) is not None
            for g, size in self.block_sizes(ranks).items()
        )

    def hand_over(self, name: str, index: int, ranks: Mapping[str, int]) -> None:
        """Give slot `index` and its whole blocks to `name` (LOADING) while the sequences
        that reference it run their last step: its adapter is evicted now and the refs
        drain when they finish. The caller orders the new copies after that step's reads
        (StepProgress) and checks can_hand_over(): the blocks are kept whole, since the
        running step still reads their rows and no other adapter may be written there
        meanwhile (trim() gives back what `ranks` do not need once the load has landed);
        a group where `ranks` needs rows the slot lacks gets a free block (no running
        sequence reads free rows)."""
        slot = self.slots[index]
        if slot.pinned or slot.state is not SlotState.READY:
            raise ValueError(f"slot {index} cannot be handed over: {slot}")
        if name in self._by_name:
            raise ValueError(f"adapter {name!r} already has slot {self._by_name[name]}")
        if not self.can_hand_over(index, ranks):
            raise ValueError(f"slot {index} cannot hold {name!r} of ranks {dict(ranks)}")
        for g, size in self.block_sizes(ranks).items():
            if g not in slot.blocks:
                start = self.arenas[g].find_free(size)
                self.arenas[g].take(start, size, index)
                slot.blocks[g] = (start, size)
        self._forget(slot)
        self.num_evictions += 1
        self._claim(slot, name)

    def trim(self, index: int, ranks: Mapping[str, int]) -> None:
        """Give back the rows of handed-over slot `index` that its adapter's `ranks` do not
        need, once the step that read its old adapter is over (its load has landed): each
        group keeps its block's first rows (an aligned block of any smaller size), a
        group it does not target none. Only while no step reads the slot: LOADING, or
        READY and unreferenced."""
        slot = self.slots[index]
        assert slot.state is SlotState.LOADING or not slot.refs, slot
        need = self.block_sizes(ranks)
        for g, (row0, rows) in list(slot.blocks.items()):
            keep = need.get(g, 0)
            if keep >= rows:
                continue
            self.arenas[g].give_back(row0 + keep, rows - keep)
            if keep:
                self.arenas[g].size[row0 : row0 + keep] = keep
                slot.blocks[g] = (row0, keep)
            else:
                del slot.blocks[g]

    def mark_ready(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is SlotState.LOADING, slot
        slot.state = SlotState.READY
        self.policy.insert(slot.adapter)

    def cancel(self, index: int) -> None:
        """A load failed: the slot and its rows are free again."""
        slot = self.slots[index]
        assert slot.state is SlotState.LOADING, slot
        self._by_name.pop(slot.adapter, None)
        self._free(slot)

    def evict(self, name: str) -> bool:
        """Free `name`'s slot now if nothing uses it (unload); False if it is busy."""
        i = self._by_name.get(name)
        if i is None:
            return True
        slot = self.slots[i]
        if slot.refs or slot.state is not SlotState.READY or slot.pinned:
            return False
        self._drop(slot)
        return True

    def acquire(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is SlotState.READY, slot
        slot.refs += 1
        if slot.adapter is not None:
            self.policy.touch(slot.adapter)
            if not slot.used:
                slot.used = True
                self.num_used_loads += 1

    def release(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.refs > 0, slot
        slot.refs -= 1

    def check_integrity(self) -> None:
        base = self.slots[0]
        assert base.pinned and base.state is SlotState.READY and base.adapter is None, base
        assert not base.blocks, base
        for name, i in self._by_name.items():
            assert self.slots[i].adapter == name and self.slots[i].state is not SlotState.FREE
        owned = {g: np.full(self.num_rows, -1, dtype=np.int32) for g in self.arenas}
        for s in self.slots[1:]:
            assert s.refs >= 0
            assert (s.state is SlotState.FREE) == (s.adapter is None), s
            assert s.state is SlotState.READY or s.refs == 0, s
            if s.adapter is not None:
                assert self._by_name.get(s.adapter) == s.index, s
                for g, (row0, rows) in s.blocks.items():
                    assert rows and row0 % rows == 0, s
                    assert (self.arenas[g].size[row0 : row0 + rows] == rows).all(), s
                    owned[g][row0 : row0 + rows] = s.index
            else:
                assert not s.blocks and s.index in self._free_handles, s
        for g, arena in self.arenas.items():
            assert (owned[g] == arena.owner).all(), f"{g}: arena rows and slots disagree"

    # -- internals -----------------------------------------------------------------------------

    def _evictable(self, protected: set[str]) -> dict[str, Slot]:
        return {
            s.adapter: s
            for s in self.slots
            if s.state is SlotState.READY and not s.refs and not s.pinned
            and s.adapter not in protected
        }  # fmt: skip

    def _costs(self, protected: set[str]) -> np.ndarray:
        """Per slot, its place in the policy's eviction order (first to go: cheapest);
        inf for slots that may not be evicted."""
        candidates = self._evictable(protected)
        cost = np.full(len(self.slots), math.inf)
        for rank, name in enumerate(self.policy.eviction_order(candidates)):
            cost[candidates[name].index] = rank
        return cost

    def _can_place(self, sizes: dict[str, int], protected: set[str]) -> bool:
        """Whether every group has a free block or a region it may evict, checked before
        evicting anything: evictions only free rows, so each group's answer holds after
        the others' evictions, and a load that cannot be placed evicts no one."""
        cost = self._costs(protected)
        return all(
            self.arenas[g].find_free(size) is not None
            or self.arenas[g].cheapest_region(size, cost) is not None
            for g, size in sizes.items()
        )

    def _evict_one(self, protected: set[str]) -> bool:
        """Free a handle (every one is taken): the policy's victim among all adapters."""
        candidates = self._evictable(protected)
        name = self.policy.select_victim(candidates)
        if name is None:
            return False
        self._drop(candidates[name])
        self.num_evictions += 1
        return True

    def _blocks_for(self, sizes: dict[str, int], protected: set[str]) -> dict[str, int]:
        """A free aligned block per group (largest first), evicting one region's occupants
        in a group that has none (_can_place said each group can)."""
        starts = {}
        for g, size in sorted(sizes.items(), key=lambda item: -item[1]):
            arena = self.arenas[g]
            start = arena.find_free(size)
            if start is None:
                start = arena.cheapest_region(size, self._costs(protected))
                assert start is not None, (g, size)
                for index in arena.region_owners(start, size):
                    self._drop(self.slots[index])
                    self.num_evictions += 1
            starts[g] = start
        return starts

    def _claim(self, slot: Slot, name: str) -> None:
        """`slot` (with its rows taken) starts loading `name`."""
        slot.adapter, slot.state, slot.used = name, SlotState.LOADING, False
        self._by_name[name] = slot.index

    def _forget(self, slot: Slot) -> None:
        """The slot's adapter leaves (its rows stay with the slot)."""
        self._by_name.pop(slot.adapter, None)
        self.policy.remove(slot.adapter)

    def _drop(self, slot: Slot) -> None:
        self._forget(slot)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        for g, (row0, rows) in slot.blocks.items():
            self.arenas[g].give_back(row0, rows)
        slot.adapter, slot.state, slot.blocks = None, SlotState.FREE, {}
        self._free_handles.append(slot.index)


class EvictionPolicy(Protocol):
    def touch(self, name: str) -> None:
        """`name` was used (admitted into a batch)."""

    def insert(self, name: str) -> None:
        """`name` was loaded."""

    def remove(self, name: str) -> None:
        """`name` left."""

    def select_victim(self, candidates: Iterable[str]) -> str | None:
        """The candidate to evict, or None if there is none."""

    def eviction_order(self, candidates: Iterable[str]) -> list[str]:
        """Every candidate, the one to evict first first (choosing among regions)."""


class LRUPolicy:
    """Evict the candidate used longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # oldest first

    def touch(self, name: str) -> None:
        self._order[name] = None
        self._order.move_to_end(name)

    def insert(self, name: str) -> None:
        self.touch(name)

    def remove(self, name: str) -> None:
        self._order.pop(name, None)

    def select_victim(self, candidates: Iterable[str]) -> str | None:
        allowed = set(candidates)
        return next((n for n in self._order if n in allowed), None)

    def eviction_order(self, candidates: Iterable[str]) -> list[str]:
        allowed = set(candidates)
        return [n for n in self._order if n in allowed]


class FIFOPolicy(LRUPolicy):
    """Evict the candidate loaded longest ago, however recently it was used."""

    def touch(self, name: str) -> None:
        if name not in self._order:
            self._order[name] = None


def make_policy(name: str) -> EvictionPolicy:
    policies = {"lru": LRUPolicy, "fifo": FIFOPolicy}
    if name not in policies:
        raise ValueError(f"eviction policy {name!r}: expected one of {', '.join(policies)}")
    return policies[name]()
