"""The cluster's adapter source: converted weights fetched from Ray's object store.

The AdapterStore converts each adapter once and `ray.put`s it; a replica only
ever holds ObjectRefs here, and `fetch` (on the loader thread) maps the arrays
zero-copy and copies them into host memory, where the host cache pins them.
Each registered version is its own key (str of a wire.AdapterKey), so re-registering a
name never serves stale weights from a slot or the host cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import ray

from replica.adapters.packing import unpack_adapter
from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA


@dataclass(frozen=True)
class ObjectRefLocator:
    ref: ray.ObjectRef  # a packed adapter (adapter_packing)

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        """Maps the arrays zero-copy (same node) and copies only what `select` keeps."""
        return unpack_adapter(ray.get(self.ref), name, select)


class ObjectStoreSource:
    """key -> ObjectRef of a packed adapter; thread-safe (the loader thread fetches)."""

    def __init__(self) -> None:
        self._refs: dict[str, ray.ObjectRef] = {}
        self._ranks: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str, ref: ray.ObjectRef, rank: int | None = None) -> None:
        """`rank`, the store's record of it, lets a load reserve rows before fetching."""
        with self._lock:
            self._refs[key] = ref
            if rank is not None:
                self._ranks[key] = rank

    def remove(self, key: str) -> None:
        """Drop the reference, so the object store can free the weights once unused."""
        with self._lock:
            self._refs.pop(key, None)
            self._ranks.pop(key, None)

    def rank_of(self, key: str) -> int | None:
        with self._lock:
            return self._ranks.get(key)

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
            return ObjectRefLocator(self._refs[name])
