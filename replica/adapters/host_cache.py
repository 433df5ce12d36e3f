"""Adapters staged in (pinned) host memory under a byte budget, LRU, filled from a source."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from replica.adapters.sources import AdapterSource
from replica.device import HostPacking
from replica.model.adapter_weights import LoRAAdapterWeights


class HostCache:
    """LRU of converted adapters in host memory. Thread-safe: the loader thread fills it.

    The budget bounds the memory the staged copies hold at every moment, as the allocator
    holds it (HostPacking.nbytes: pinned chunks, not the tensors' bytes): room is made by
    evicting before a new copy is allocated, never after. An adapter larger than the
    whole budget is returned from the source's memory, not staged. An evicted adapter's
    memory goes when the last load still copying from it lets go of it."""

    def __init__(self, source: AdapterSource, budget_bytes: int) -> None:
        self.source, self.budget = source, budget_bytes
        self._items: OrderedDict[str, tuple[LoRAAdapterWeights, int]] = OrderedDict()
        self._held = 0  # bytes of the staged copies, and of those being staged
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Host memory the staged adapters hold (and those being staged now)."""
        return self._held

    def get(self, name: str) -> LoRAAdapterWeights:
        """The adapter's host copy, fetched from the source (and pinned) on a miss."""
        with self._lock:
            hit = self._items.get(name)
            if hit is not None:
                self._items.move_to_end(name)
                return hit[0]
        return self._stage(name, self.source.fetch(name))  # I/O outside the lock

    def put(self, name: str, adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
        """Stage an adapter read elsewhere (a registration that converted it), replacing
        any copy of `name`; the (pinned) host copy."""
        self.drop(name)
        return self._stage(name, adapter)

    def _stage(self, name: str, adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
        """`adapter` copied into host memory made room for first, and cached as `name`;
        `adapter` itself, uncached, when it is larger than the budget."""
        keys = list(adapter.weights)
        tensors = [t for k in keys for t in adapter.weights[k]]
        packing = HostPacking(tensors)
        with self._lock:
            if not self._make_room(packing.nbytes):
                return adapter
            self._held += packing.nbytes
        try:
            copies = iter(packing.copy(tensors))
        except BaseException:
            with self._lock:
                self._held -= packing.nbytes
            raise
        staged = replace(adapter, weights={k: (next(copies), next(copies)) for k in keys})
        with self._lock:
            replaced = self._items.pop(name, None)  # staged meanwhile by another thread
            if replaced is not None:
                self._held -= replaced[1]
            self._items[name] = (staged, packing.nbytes)
        return staged

    def peek(self, name: str) -> LoRAAdapterWeights | None:
        """A staged adapter (None if not in host memory); no fetch, no LRU touch."""
        with self._lock:
            hit = self._items.get(name)
            return None if hit is None else hit[0]

    def drop(self, name: str) -> None:
        with self._lock:
            hit = self._items.pop(name, None)
            if hit is not None:
                self._held -= hit[1]

    def names(self) -> list[str]:
        """Adapters staged in host memory now, least recently used first."""
        with self._lock:
            return list(self._items)

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used adapters until `nbytes` more fit the budget (under the
        lock); False, evicting nothing, if they never can."""
        if nbytes > self.budget:
            return False
        while self._held + nbytes > self.budget and self._items:
            _, (_, held) = self._items.popitem(last=False)
            self._held -= held
        return self._held + nbytes <= self.budget
