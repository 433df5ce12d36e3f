"""Which unused adapter slot to give up: tiny policy objects, tested with plain strings."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol


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
