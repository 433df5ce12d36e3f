"""The cluster's adapter source: converted weights fetched from Ray's object store.

The AdapterStore converts each adapter once and `ray.put`s it; a replica only
ever holds the store's references here (with each version's ranks per group, so a load
reserves its rows before fetching), and `fetch` (on the loader thread) maps the arrays
zero-copy and copies them into host memory, where the host cache pins them.
Each registered version is its own key (str of a wire.AdapterKey), so re-registering a
name never serves stale weights from a slot or the host cache.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray

from replica.adapters.packing import unpack_adapter
from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA
from replica.wire import AdapterWeightsRef


@dataclass(frozen=True)
class ObjectRefLocator:
    ref: ray.ObjectRef  # a packed adapter (adapter_packing)

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        """Maps the arrays zero-copy (same node) and copies only what `select` keeps."""
        return unpack_adapter(ray.get(self.ref), name, select)


class ObjectStoreSource:
    """key -> the store's AdapterWeightsRef of one version (its ranks per group, and the
    reference of its packed weights); thread-safe (the loader thread fetches)."""

    def __init__(self) -> None:
        self._refs: dict[str, AdapterWeightsRef] = {}
        self._lock = threading.Lock()

    def add(self, stored: AdapterWeightsRef) -> str:
        """Hold one version's reference, under its key (str of its AdapterKey), returned."""
        key = str(stored.info.key)
        with self._lock:
            self._refs[key] = stored
        return key

    def remove(self, key: str) -> None:
        """Drop the reference, so the object store can free the weights once unused."""
        with self._lock:
            self._refs.pop(key, None)

    def ranks(self, key: str) -> Mapping[str, int]:
        with self._lock:
            return self._refs[key].info.ranks

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._refs

    def names(self) -> list[str]:
        with self._lock:
            return list(self._refs)

    def fetch(self, name: str) -> LoRAAdapterWeights:
        return self.locate(name).fetch(name)

    def locate(self, name: str) -> ObjectRefLocator:
        with self._lock:
            return ObjectRefLocator(self._refs[name].weights)
