"""An engine's adapters from registration to device slot, and their lifecycle.

Wires, once, the chain every adapter travels: source (PEFT directories, or the object
store) -> host cache (pinned) -> loader (side stream / worker thread) -> slot pool and
slot buffers, with the prefetcher deciding what moves when. The engine asks it three
things per step (poll finished loads, prefetch for the waiting queue, hand over the slots
a step frees) and tells it which adapters requests still use, so an unloaded adapter's
weights go only once its last request has ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replica.adapters.host_cache import HostCache
from replica.adapters.prefetcher import LoadFailure, Prefetcher
from replica.adapters.slot_pool import AdapterSlotPool, SlotState, make_policy
from replica.adapters.sources import AdapterLocator, AdapterSource, PeftDirectorySource
from replica.config import EngineConfig
from replica.device import InlineLoader, SideStreamLoader, StepProgress
from replica.errors import RequestError
from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA
from replica.model.lora_slots import LoRASlotBuffers, SlotTable

BASE_KEY = "__base__"  # the base model's pool name when its slot is not pinned (ablation)

# What the executor makes of a source: where each rank's host cache fetches from (and what
# it keeps of a whole adapter: `stage`), and what slot writes go through (rank 0's buffers
# alone, or every rank's; see adapters/sharded.py).
Staging = Callable[[Any], tuple[Any, Any]]


@dataclass
class HandOver:
    """Slots handed over during one step: that step's view of the slots, taken before the
    hand-over cleared them, and the forward's progress the new copies wait on."""

    table: SlotTable
    progress: StepProgress


class AdapterResidency:
    def __init__(
        self,
        config: EngineConfig,
        source: AdapterSource,
        buffers: LoRASlotBuffers,
        stage: Staging,
        device: torch.device,
    ) -> None:
        """`buffers`: rank 0's slot buffers (their host ranks and scalings describe every
        rank's); `stage`: the executor's adapter_staging."""
        c = config.adapters
        self.source, self.buffers, self.device = source, buffers, device
        self.staged, slots = stage(_WithBase(source))
        self.host_cache = HostCache(self.staged, c.host_cache_bytes)
        self.pool = AdapterSlotPool(
            c.num_slots, make_policy(c.eviction_policy), config.max_lora_rank, buffers.groups
        )
        self.sync = c.adapter_loading == "sync"
        self.loader = InlineLoader(device) if self.sync else SideStreamLoader(device)
        window = c.max_loras_per_batch if self.sync else c.prefetch_window
        self.prefetcher = Prefetcher(
            self.pool, slots, self.host_cache, self.loader, window, c.max_loads_in_flight,
            self.ranks_of,
        )  # fmt: skip
        self.max_loads_in_flight = c.max_loads_in_flight
        self.unloading: set[str] = set()  # refused for new requests; weights go when unused

    # -- registry ------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        """Register a PEFT directory as `name`: read, validated and staged in the host cache
        now (once: the source's conversion is what is staged), copied into a device slot
        when a request needs it. Nothing is registered on error; a name already registered
        is refused (unload it first)."""
        if not isinstance(self.source, PeftDirectorySource):
            raise TypeError("registering a directory needs the PEFT directory source")
        if name in self.unloading:
            raise RequestError(f"adapter {name!r} is being unloaded: requests on it still run")
        if name in self.source:  # its slot would go on serving the weights it holds
            raise RequestError(f"adapter {name!r} is already registered: unload it first")
        return self.host_cache.put(name, self.staged.stage(self.source.add(name, path)))

    def unregister(self, name: str) -> None:
        """Refuse `name` for new requests; its weights go at release_unloaded, once unused."""
        self.unloading.add(name)

    def known(self) -> list[str]:
        return [n for n in self.source.names() if n not in self.unloading]

    def is_known(self, name: str) -> bool:
        """Whether requests may name `name` (without listing every adapter)."""
        return name in self.source and name not in self.unloading

    def release_unloaded(self, in_use: set[str | None]) -> None:
        """Free what unloaded adapters hold (source entry, host copy, slot) once no request
        in `in_use` (waiting or running) needs them and no load of theirs is in flight."""
        for name in list(self.unloading):
            if name in in_use or self.prefetcher.is_loading(name):
                continue
            if self.pool.evict(name):  # the slot's rank is zeroed when it is reserved again
                self.source.remove(name)
                self.host_cache.drop(name)
                self.unloading.discard(name)

    def ranks_of(self, name: str) -> Mapping[str, int]:
        """`name`'s rank per projection group, the source's record (known since it was
        registered, without fetching it): what a load of it reserves."""
        return {} if name == BASE_KEY else self.source.ranks(name)

    def tier(self, name: str) -> str:
        """Where `name` is now: "device" (a slot, ready or loading), "host", or "miss"."""
        if self.pool.state(name) is not None:
            return "device"
        return "host" if self.host_cache.peek(name) is not None else "miss"

    # -- per step ------------------------------------------------------------------------------

    def poll(self) -> list[LoadFailure]:
        """Activate finished loads (never blocks); the failed ones."""
        return self.prefetcher.poll()

    def prefetch(self, wanted: Iterable[str | None]) -> None:
        """Start loads for the adapters of the first waiting requests (queue order)."""
        self.prefetcher.prefetch(wanted)

    def hand_over(
        self, ending_refs: dict[int, int], wanted: Iterable[str | None]
    ) -> HandOver | None:
        """Load waiting requests' adapters into slots the running step is the last to read:
        `ending_refs` counts, per slot, the running sequences that end with this step; a
        slot all of whose references end is handed over. None when nothing was."""
        if self.sync or self.prefetcher.num_inflight >= self.max_loads_in_flight:
            return None
        slots = self.pool.slots
        ending = [i for i, n in ending_refs.items() if slots[i].refs == n and not slots[i].pinned]
        if not ending:
            return None
        view = HandOver(self.buffers.view(), StepProgress(self.device))
        return view if self.prefetcher.hand_over(wanted, ending, view.progress) else None

    def wait_idle(self, timeout_s: float) -> bool:
        """Nothing can run until a load lands: wait for one (True if any was in flight)."""
        if not self.prefetcher.num_inflight:
            return False
        self.prefetcher.wait_any(timeout_s)
        return True

    def wait_ready(self, key: str | None, timeout_s: float = 60.0) -> int:
        """The slot of `key` once it is loaded, loading it now if needed (offline scoring:
        no step loop runs meanwhile)."""
        if key is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            slot = self.pool.ready_slot(key)
            if slot is not None:
                return slot
            if not self.prefetcher.is_loading(key) and not self.prefetcher.start(key):
                raise RequestError(f"no adapter slot can be freed for {key!r}")
            time.sleep(0.001)
            for failure in self.prefetcher.poll():
                if failure.name == key:
                    raise RequestError(str(failure.error))
        raise TimeoutError(f"adapter {key!r} did not load within {timeout_s}s")

    @property
    def load_wait_seconds(self) -> float:
        """Caller time blocked inside loads (the whole load when they run inline)."""
        return self.prefetcher.blocked_seconds

    def device_adapters(self) -> list[str]:
        """Adapters whose slot is READY (the unpinned base aside)."""
        return [
            s.adapter
            for s in self.pool.slots
            if s.state is SlotState.READY and s.adapter not in (None, BASE_KEY)
        ]

    def shutdown(self) -> None:
        self.loader.shutdown()


class _WithBase:
    """The source, plus the base model as a rank-0 adapter (used only when its slot is unpinned)."""

    def __init__(self, source: AdapterSource) -> None:
        self.source = source

    def names(self) -> list[str]:
        return self.source.names()

    def fetch(self, name: str) -> LoRAAdapterWeights:
        if name == BASE_KEY:
            return _BaseLocator().fetch(name)
        return self.source.fetch(name)

    def locate(self, name: str) -> AdapterLocator:
        return _BaseLocator() if name == BASE_KEY else self.source.locate(name)

    def stage(self, adapter: LoRAAdapterWeights) -> LoRAAdapterWeights:
        """What the host cache holds of a whole adapter: all of it (one rank)."""
        return adapter


class _BaseLocator:
    """The base model as an adapter: rank 0, no weights."""

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        return LoRAAdapterWeights(BASE_KEY, 0, 0.0, (), {})
