"""Which adapter lives in which slot and which arena rows: states, references, eviction.

Host-only bookkeeping over LoRASlotBuffers. A slot is a handle (an index into the
per-slot rank/scaling/offset tables the kernels read); the weights live in arena rows,
a block sized by the adapter's own rank (replica/adapters/arena.py), so a rank-8
adapter holds an eighth of what a rank-64 one does. Index ranges:
  slot 0          the base model: pinned, always READY, holds no rows, never evicted
  slots 1..S-1    adapters: FREE -> LOADING (a copy is in flight) -> READY -> (evicted) FREE
An adapter may be evicted only when READY, unreferenced (no sequence in the running
batch uses it) and unpinned; LOADING slots are never touched. When no free block fits
an adapter, the policy picks the aligned region whose occupants are cheapest to evict.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from replica.adapters.arena import RowArena
from replica.adapters.eviction import EvictionPolicy
from replica.model.lora_slots import arena_rows, block_rows, num_slot_handles


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
    row0: int = 0  # first arena row of the adapter's block
    rows: int = 0  # the block's rows (block_rows(rank); 0 when free)


class AdapterSlotPool:
    def __init__(self, num_slots: int, policy: EvictionPolicy, max_rank: int = 64) -> None:
        """Room for num_slots - 1 adapters of max_rank (more of lower ranks)."""
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2: slot 0 is the base model, adapters need one")
        self.arena = RowArena(arena_rows(num_slots, max_rank), max_rank)
        self.slots = [Slot(i) for i in range(num_slot_handles(self.arena.num_rows))]
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
        """Loads of any rank that evict no one: whole free blocks of max_lora_rank."""
        return self.arena.free_top_blocks()

    @property
    def rows_used(self) -> int:
        """Arena rows held by adapters (loading or ready): the sum of their blocks."""
        return self.arena.rows_used

    def occupancy(self) -> dict[str, int]:
        """Adapters (slot 0 aside) by state, and free as num_free."""
        counts = {state.value: 0 for state in SlotState}
        for i in self._by_name.values():
            counts[self.slots[i].state.value] += 1
        counts[SlotState.FREE.value] = self.num_free
        return counts

    # -- transitions ---------------------------------------------------------------------------

    def reserve(
        self, name: str, protected: set[str] = frozenset(), rank: int | None = None
    ) -> int | None:
        """A slot and rows for `name` (rank `rank`; unknown: max_lora_rank) to be loaded
        into (marked LOADING), evicting if needed; None when nothing can be evicted.
        Adapters in `protected` (wanted by requests about to run) are not evicted."""
        if name in self._by_name:
            raise ValueError(f"adapter {name!r} already has slot {self._by_name[name]}")
        size = block_rows(self.max_rank if rank is None else rank)
        if not self._free_handles and not self._evict_one(protected):
            return None
        start = 0 if size == 0 else self._rows_for(size, protected)
        if start is None:
            return None
        slot = self.slots[self._free_handles.pop()]
        self.arena.take(start, size, slot.index)
        slot.row0, slot.rows = start, size
        self._claim(slot, name)
        return slot.index

    def fits(self, index: int, rank: int | None) -> bool:
        """Whether slot `index`'s block can hold an adapter of `rank` (hand-over)."""
        return block_rows(self.max_rank if rank is None else rank) <= self.slots[index].rows

    def hand_over(self, name: str, index: int) -> None:
        """Give slot `index` and its whole block to `name` (LOADING) while the sequences
        that reference it run their last step: its adapter is evicted now and the refs
        drain when they finish. The caller orders the new copies after that step's reads
        (StepProgress) and checks fits(): the block is kept whole, since the running step
        still reads its rows and no other adapter may be written there meanwhile."""
        slot = self.slots[index]
        if slot.pinned or slot.state is not SlotState.READY:
            raise ValueError(f"slot {index} cannot be handed over: {slot}")
        if name in self._by_name:
            raise ValueError(f"adapter {name!r} already has slot {self._by_name[name]}")
        self._forget(slot)
        self.num_evictions += 1
        self._claim(slot, name)

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
        assert base.rows == 0, base
        for name, i in self._by_name.items():
            assert self.slots[i].adapter == name and self.slots[i].state is not SlotState.FREE
        owned = np.full(self.arena.num_rows, -1, dtype=np.int32)
        for s in self.slots[1:]:
            assert s.refs >= 0
            assert (s.state is SlotState.FREE) == (s.adapter is None), s
            assert s.state is SlotState.READY or s.refs == 0, s
            if s.adapter is not None:
                assert self._by_name.get(s.adapter) == s.index, s
                assert s.rows == 0 or s.row0 % s.rows == 0, s
                owned[s.row0 : s.row0 + s.rows] = s.index
            else:
                assert s.rows == 0 and s.index in self._free_handles, s
        assert (owned == self.arena.owner).all(), "arena rows and slots disagree"

    # -- internals -----------------------------------------------------------------------------

    def _evictable(self, protected: set[str]) -> dict[str, Slot]:
        return {
            s.adapter: s
            for s in self.slots
            if s.state is SlotState.READY and not s.refs and not s.pinned
            and s.adapter not in protected
        }  # fmt: skip

    def _evict_one(self, protected: set[str]) -> bool:
        """Free a handle (every one is taken): the policy's victim among all adapters."""
        candidates = self._evictable(protected)
        name = self.policy.select_victim(candidates)
        if name is None:
            return False
        self._drop(candidates[name])
        self.num_evictions += 1
        return True

    def _rows_for(self, size: int, protected: set[str]) -> int | None:
        """A free aligned block of `size` rows, evicting one region's occupants if needed."""
        start = self.arena.find_free(size)
        if start is not None:
            return start
        candidates = self._evictable(protected)
        cost = np.full(len(self.slots), math.inf)
        for rank, name in enumerate(self.policy.eviction_order(candidates)):
            cost[candidates[name].index] = rank  # first to go: cheapest
        start = self.arena.cheapest_region(size, cost)
        if start is None:
            return None
        for index in self.arena.region_owners(start, size):
            self._drop(self.slots[index])
            self.num_evictions += 1
        return start

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
        self.arena.give_back(slot.row0, slot.rows)
        slot.adapter, slot.state, slot.row0, slot.rows = None, SlotState.FREE, 0, 0
        self._free_handles.append(slot.index)
