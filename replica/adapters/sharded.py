"""Adapters under tensor parallelism: each rank stages only its own shard, in the slot
rank 0 chose.

Rank 0's slot pool decides everything (which adapter goes into which slot, what is
evicted, the pinned base slot), exactly as with one rank. ShardedSlotWriter then has
every other rank copy its shard of the same adapter into the same arena rows and reports the
load done only once all ranks are, so no step ever reads a slot some rank is still
writing. Each rank fetches its shard itself, through the locator rank 0 sends along (a
PEFT directory, or an object-store reference whose arrays are sliced before copying).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from replica.adapters.sources import AdapterLocator
from replica.device import StepProgress
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.lora_slots import LoRASlotBuffers, Rows
from replica.model.tp_shard import TPShard


class RankLoads(Protocol):
    """Loads on ranks 1..N-1 (the executor's TPGroup): start them, then wait for all."""

    def load_on_ranks(
        self, rows: Rows, name: str, locator: AdapterLocator, after_step: int | None = None
    ) -> list[Any]:
        """Ranks 1..N-1 start copying their shards of `name` into each group's arena rows
        from `rows[group]`, each behind its own step `after_step` when given."""

    def wait_loads(self, pending: list[Any]) -> None:
        """Block until every started load is done; raise if a rank failed."""


class ShardedSource:
    """What a rank's HostCache fetches from: only this rank's shard of each adapter."""

    def __init__(self, source, shard: TPShard) -> None:
        self.source, self.shard = source, shard  # source: anything with locate(name)

    def fetch(self, name: str) -> LoRAAdapterWeights:
        return self.source.locate(name).fetch(name, self.shard.slice_lora)

    def stage(self, adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
        """This rank's shard of a whole adapter (one converted elsewhere)."""
        return adapter.select(self.shard.slice_lora)


class ShardedSlotWriter:
    """Rank 0's slot buffers, as the prefetcher uses them, with writes fanned out: each
    other rank loads its own shard of the adapter into the same slot."""

    def __init__(
        self,
        local: LoRASlotBuffers,
        group: RankLoads,
        locate: Callable[[str], AdapterLocator],
    ) -> None:
        self.local, self.group, self.locate = local, group, locate

    def write(
        self, rows: Rows, adapter: LoRAAdapterWeights, progress: StepProgress | None = None
    ) -> None:
        """Runs on rank 0's loader thread; returns once every rank holds the adapter.
        A hand-over (`progress`: the step that still reads the rows) is ordered on each
        rank: rank 0 writes behind its own step's layers, every other rank behind the same
        step of its own, named by its number."""
        after = None if progress is None else progress.step_number()
        pending = self.group.load_on_ranks(rows, adapter.name, self.locate(adapter.name), after)
        self.local.write(rows, adapter, progress)
        self.group.wait_loads(pending)

    def group_ranks(self, adapter: LoRAAdapterWeights) -> dict[str, int]:
        return self.local.group_ranks(adapter)  # a shard's ranks are the whole adapter's

    def activate(self, slot: int, rows: Rows, adapter: LoRAAdapterWeights) -> None:
        self.local.activate(slot, rows, adapter)  # host state: only rank 0 plans batches

    def clear(self, slot: int) -> None:
        self.local.clear(slot)
