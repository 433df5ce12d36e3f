"""Adapters staged in (pinned) host memory under a byte budget, LRU, filled from a source."""

from __future__ import annotations

import threading
from collections import OrderedDict

from replica.adapters.sources import AdapterSource
from replica.device import pinned
from replica.model.adapter_weights import LoRAAdapterWeights


class HostCache:
    """LRU of converted adapters in host memory. Thread-safe: the loader thread fills it."""

    def __init__(self, source: AdapterSource, budget_bytes: int) -> None:
        self.source, self.budget = source, budget_bytes
        self._items: OrderedDict[str, LoRAAdapterWeights] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRAAdapterWeights:
        """The adapter's host copy, fetched from the source (and pinned) on a miss."""
        with self._lock:
            hit = self._items.get(name)
            if hit is not None:
                self._items.move_to_end(name)
                return hit
        adapter = _pin(self.source.fetch(name))  # I/O outside the lock
        with self._lock:
            self._items[name] = adapter
            self._items.move_to_end(name)
            self._shrink()
        return adapter

    def put(self, name: str, adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
        """Stage an adapter read elsewhere (a registration that converted it), replacing
        any copy of `name`; the (pinned) host copy."""
        adapter = _pin(adapter)
        with self._lock:
            self._items[name] = adapter
            self._items.move_to_end(name)
            self._shrink()
        return adapter

    def peek(self, name: str) -> LoRAAdapterWeights | None:
        """A staged adapter (None if not in host memory); no fetch, no LRU touch."""
        with self._lock:
            return self._items.get(name)

    def drop(self, name: str) -> None:
        with self._lock:
            self._items.pop(name, None)

    def names(self) -> list[str]:
        """Adapters staged in host memory now, least recently used first."""
        with self._lock:
            return list(self._items)

    def _shrink(self) -> None:
        total = sum(a.nbytes for a in self._items.values())
        while total > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            total -= old.nbytes


def _pin(adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
    adapter.weights = {k: (pinned(a), pinned(b)) for k, (a, b) in adapter.weights.items()}
    return adapter
