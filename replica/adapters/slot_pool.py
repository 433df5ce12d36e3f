"""Which adapter lives in which device slot: states, reference counts, eviction.

Host-only bookkeeping over LoRASlotBuffers. Index ranges:
  slot 0          the base model: pinned, always READY, never evicted, never loaded
  slots 1..S-1    adapters: FREE -> LOADING (a copy is in flight) -> READY -> (evicted) FREE
A slot may be evicted only when READY, unreferenced (no sequence in the
running batch uses it) and unpinned; LOADING slots are never touched.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from replica.adapters.eviction import EvictionPolicy


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


class AdapterSlotPool:
    def __init__(self, num_slots: int, policy: EvictionPolicy, max_rank: int = 64) -> None:
        if num_slots < 2:
            raise ValueError("num_slots must be >= 2: slot 0 is the base model, adapters need one")
        self.slots = [Slot(i) for i in range(num_slots)]
        self.slots[0] = Slot(0, None, SlotState.READY, pinned=True)
        self.policy, self.max_rank = policy, max_rank
        self._by_name: dict[str, int] = {}
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
        return sum(1 for s in self.slots if s.state is SlotState.FREE)

    def occupancy(self) -> dict[str, int]:
        """Adapter slots (slot 0 aside) by state: free, loading, ready."""
        counts = {state.value: 0 for state in SlotState}
        for s in self.slots[1:]:
            counts[s.state.value] += 1
        return counts

    # -- transitions ---------------------------------------------------------------------------

    def reserve(
        self, name: str, protected: set[str] = frozenset(), rank: int | None = None
    ) -> int | None:
        """A slot for `name` to be loaded into (marked LOADING), evicting if needed.

        Adapters in `protected` (wanted by requests about to run) are not evicted.
        `rank`, when known, places the adapter among free slots (see _free_slot)."""
        slot = self._free_slot(rank) or self._victim(protected)
        if slot is None:
            return None
        self._claim(slot, name)
        return slot.index

    def hand_over(self, name: str, index: int) -> None:
        """Give slot `index` to `name` (LOADING) while the sequences that reference it run
        their last step: its adapter is evicted now and the refs drain when they finish.
        The caller orders the new copies after that step's reads (StepProgress)."""
        slot = self.slots[index]
        if slot.pinned or slot.state is not SlotState.READY:
            raise ValueError(f"slot {index} cannot be handed over: {slot}")
        self._claim(slot, name)

    def mark_ready(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.state is SlotState.LOADING, slot
        slot.state = SlotState.READY
        self.policy.insert(slot.adapter)

    def cancel(self, index: int) -> None:
        """A load failed: the slot is free again."""
        slot = self.slots[index]
        assert slot.state is SlotState.LOADING, slot
        self._by_name.pop(slot.adapter, None)
        slot.adapter, slot.state = None, SlotState.FREE

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
        for name, i in self._by_name.items():
            assert self.slots[i].adapter == name and self.slots[i].state is not SlotState.FREE
        for s in self.slots[1:]:
            assert s.refs >= 0
            assert (s.state is SlotState.FREE) == (s.adapter is None), s
            assert s.state is SlotState.READY or s.refs == 0, s
            if s.adapter is not None:
                assert self._by_name.get(s.adapter) == s.index, s

    # -- internals -----------------------------------------------------------------------------

    def _free_slot(self, rank: int | None) -> Slot | None:
        """A FREE slot; for a known rank the one nearest that rank's home. Homes spread
        rank classes (powers of two) over the slot range, so adapters of one class sit in
        adjacent slots and the CPU LoRA ops read them as one run (one matmul over a view of
        the buffers) with little padding to a larger rank. Eviction is the policy's alone."""
        free = [s for s in self.slots if s.state is SlotState.FREE]
        if not free or rank is None:
            return free[0] if free else None
        home = rank_home(rank, self.max_rank, len(self.slots))
        return min(free, key=lambda s: (abs(s.index - home), s.index))

    def _victim(self, protected: set[str] = frozenset()) -> Slot | None:
        candidates = {
            s.adapter: s
            for s in self.slots
            if s.state is SlotState.READY and not s.refs and not s.pinned
            and s.adapter not in protected
        }  # fmt: skip
        name = self.policy.select_victim(candidates)
        return candidates.get(name) if name is not None else None

    def _claim(self, slot: Slot, name: str) -> None:
        """`slot` (FREE, or READY and evicted here) starts loading `name`."""
        if name in self._by_name:
            raise ValueError(f"adapter {name!r} already has slot {self._by_name[name]}")
        if slot.state is not SlotState.FREE:
            self._drop(slot)
            self.num_evictions += 1
        slot.adapter, slot.state, slot.used = name, SlotState.LOADING, False
        self._by_name[name] = slot.index

    def _drop(self, slot: Slot) -> None:
        self._by_name.pop(slot.adapter, None)
        self.policy.remove(slot.adapter)
        slot.adapter, slot.state = None, SlotState.FREE


def rank_home(rank: int, max_rank: int, num_slots: int) -> float:
    """Preferred slot of a rank-`rank` adapter: the centre of its rank class's share of
    slots 1..num_slots-1, classes being powers of two from 8 (and below) to max_rank."""
    num_classes = max(math.ceil(math.log2(max(max_rank, 8))) - 2, 1)
    cls = min(max(math.ceil(math.log2(max(rank, 1))) - 3, 0), num_classes - 1)
    return 1 + (cls + 0.5) / num_classes * (num_slots - 1) - 0.5
