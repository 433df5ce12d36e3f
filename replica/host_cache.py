"""Adapters staged in (pinned) host memory under a byte budget, LRU, filled from a source."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from replica.adapter_format import LoRAAdapterWeights, SelectLoRA, load_peft_adapter
from replica.device import pinned
from replica.model_config import ModelSpec


class AdapterLocator(Protocol):
    """Where one adapter's weights are, in a form another process can read them from
    (picklable): tensor-parallel ranks each fetch their own shard through it."""

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        """The converted weights, only the part `select` picks if given."""


class AdapterSource(Protocol):
    """Where adapter weights come from (a PEFT directory here, the object store in a cluster)."""

    def fetch(self, name: str) -> LoRAAdapterWeights:
        """Converted weights of `name`; raises KeyError if unknown."""

    def locate(self, name: str) -> AdapterLocator:
        """Where `name`'s weights are; raises KeyError if unknown."""

    def names(self) -> list[str]:
        """Every adapter the source can provide."""

    def remove(self, name: str) -> None:
        """Forget `name` (unloaded)."""


@dataclass(frozen=True)
class PeftDirectoryLocator:
    path: str
    spec: ModelSpec
    max_lora_rank: int
    generation: int  # changes when the name is registered again: other ranks re-read it

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        adapter = load_peft_adapter(self.path, self.spec, self.max_lora_rank, name)
        return adapter if select is None else adapter.select(select)


class PeftDirectorySource:
    """Adapters read from PEFT directories through the one conversion function."""

    def __init__(self, spec: ModelSpec, max_lora_rank: int, paths: dict[str, str | Path]) -> None:
        self.spec, self.max_lora_rank = spec, max_lora_rank
        self.paths = dict(paths)
        self._generations = itertools.count(1)
        self._generation: dict[str, int] = {}

    def add(self, name: str, path: str | Path) -> None:
        self.paths[name] = path
        self._generation[name] = next(self._generations)

    def remove(self, name: str) -> None:
        self.paths.pop(name, None)

    def names(self) -> list[str]:
        return list(self.paths)

    def fetch(self, name: str) -> LoRAAdapterWeights:
        return load_peft_adapter(self.paths[name], self.spec, self.max_lora_rank, name)

    def locate(self, name: str) -> PeftDirectoryLocator:
        path = str(self.paths[name])
        return PeftDirectoryLocator(
            path, self.spec, self.max_lora_rank, self._generation.get(name, 0)
        )


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

    def rank_of(self, name: str) -> int | None:
        """The rank of a staged adapter (None if not in host memory); no fetch, no LRU touch."""
        with self._lock:
            hit = self._items.get(name)
        return None if hit is None else hit.rank

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
