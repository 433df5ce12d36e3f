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
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replica.adapters.host_cache import HostCache
from replica.adapters.slot_pool import AdapterSlotPool, SlotState, make_policy
from replica.adapters.sources import AdapterLocator, AdapterSource, PeftDirectorySource
from replica.config import EngineConfig
from replica.device import InlineLoader, LoadHandle, SideStreamLoader, StepProgress, wait_any
from replica.errors import RequestError
from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA
from replica.model.lora_slots import LoRASlotBuffers, SlotTable

BASE_KEY = "__base__"  # the base model's pool name when its slot is not pinned (ablation)
# Where an adapter was when a request on it arrived: a slot (ready or loading), host memory
# only, or neither (fetched from the source).
LOOKUP_TIERS = ("device", "host", "miss")

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


# -- S-LoRA prefetch: look at the first W waiting requests and start loading their adapters --
#
# Per adapter: NOT_LOADED -> LOADING (slot reserved, copy in flight on the loader)
# -> LOADED (slot READY). Every step drains finished loads with a non-blocking
# poll before the scheduler looks at slot readiness.


@dataclass
class _InFlight:
    name: str
    slot: int
    ranks: Mapping[str, int]  # what its rows were reserved for
    handed_over: bool  # into a slot whose last step was running: its blocks kept whole
    handle: LoadHandle
    started: float
    meta: dict  # filled by the job: the adapter's weights


@dataclass
class LoadFailure:
    name: str
    error: Exception


class Prefetcher:
    def __init__(
        self,
        pool: AdapterSlotPool,
        buffers: LoRASlotBuffers,
        host_cache: HostCache,
        loader,
        window: int,
        max_inflight: int,
        ranks_of: Callable[[str], Mapping[str, int]],
    ) -> None:
        """`ranks_of(name)`: an adapter's rank per projection group, known without
        fetching it (the source's record), so a load reserves exactly the rows it needs."""
        self.pool, self.buffers, self.host_cache, self.loader = pool, buffers, host_cache, loader
        self.ranks_of = ranks_of
        self.window, self.max_inflight = window, max_inflight
        self._inflight: dict[str, _InFlight] = {}
        self.loads_started = 0
        self.loads_done = 0
        self.load_seconds = 0.0  # summed start->ready latency
        self.recent_load_seconds: deque[float] = deque(maxlen=4096)  # drained by telemetry
        self.blocked_seconds = 0.0  # caller time inside loader.submit (the whole load if inline)
        self.handovers = 0  # loads into slots whose sequences were running their last step
        # run after each load's slot write, where the load runs (LLMEngine.set_load_hook)
        self.load_hook: Callable[[LoRAAdapterWeights], None] | None = None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_loading(self, name: str) -> bool:
        return name in self._inflight

    def wait_any(self, timeout_s: float) -> None:
        """Idle until some load lands (nothing else can run): ends the wait when it does."""
        wait_any([job.handle for job in self._inflight.values()], timeout_s)

    def poll(self) -> list[LoadFailure]:
        """Activate finished loads (never blocks); return the ones that failed."""
        failures = []
        for name, job in list(self._inflight.items()):
            if not job.handle.done():
                continue
            del self._inflight[name]
            try:
                job.handle.result()
            except Exception as e:
                self.pool.cancel(job.slot)
                failures.append(LoadFailure(name, e))
                continue
            if job.handed_over:  # the step that read the slot's old adapter is over
                self.pool.trim(job.slot, job.ranks)
            self.buffers.activate(job.slot, self.pool.slots[job.slot].offsets, job.meta["adapter"])
            self.pool.mark_ready(job.slot)
            latency = time.perf_counter() - job.started
            self.loads_done += 1
            self.load_seconds += latency
            self.recent_load_seconds.append(latency)
        return failures

    def prefetch(self, wanted: Iterable[str]) -> None:
        """Start loads for adapters in `wanted` (queue order, first W) that are not resident."""
        names = self._window(wanted)
        for k, name in enumerate(names):
            if len(self._inflight) >= self.max_inflight:
                return
            if self.pool.state(name) is not None:
                continue  # loading or ready
            # Only adapters of requests ahead of this one are protected from eviction, so
            # the oldest waiting request can always claim any unreferenced slot.
            if not self.start(name, set(names[:k])):
                return  # no slot can be freed now; try again next step

    def hand_over(self, wanted: Iterable[str], ending: list[int], progress: StepProgress) -> int:
        """Load adapters the first W waiting requests need into `ending` slots: slots whose
        every sequence ends with the step now running. Each load writes a layer once the
        step is past it (`progress`, a replica.device.StepProgress), so the next requests'
        adapters are in place as the step ends instead of starting to load then.
        Returns the loads started."""
        names = self._window(wanted)
        ending = list(ending)
        started = 0
        for k, name in enumerate(names):
            if not ending or len(self._inflight) >= self.max_inflight:
                break
            if self.pool.state(name) is not None:
                continue
            # an adapter wanted by an older request stays; one nobody waits for goes first;
            # the slot's blocks (or free ones) must hold the new adapter's ranks
            ranks = self.ranks_of(name)
            free = [
                i for i in ending
                if self.pool.slots[i].adapter not in names[:k]
                and self.pool.can_hand_over(i, ranks)
            ]  # fmt: skip
            if not free:
                break
            idx = min(free, key=lambda i: self.pool.slots[i].adapter in names)
            ending.remove(idx)
            self.pool.hand_over(name, idx, ranks)
            self._submit(name, idx, ranks, progress)
            self.handovers += 1
            started += 1
        return started

    def _window(self, wanted: Iterable[str]) -> list[str]:
        names: list[str] = []
        for n in wanted:  # stop at W distinct names: never walk the whole queue each step
            if len(names) >= self.window:
                break
            if n is not None and n not in names:
                names.append(n)
        return names

    def start(self, name: str, protected: set[str] = frozenset()) -> bool:
        ranks = self.ranks_of(name)
        slot = self.pool.reserve(name, ranks, protected)
        if slot is None:
            return False
        self._submit(name, slot, ranks)
        return True

    def _submit(
        self,
        name: str,
        slot: int,
        ranks: Mapping[str, int],
        progress: StepProgress | None = None,
    ) -> None:
        self.buffers.clear(slot)
        meta: dict = {}
        rows = self.pool.slots[slot].offsets

        def job() -> None:
            weights = self.host_cache.get(name)
            fetched = {g: r for g, r in self.buffers.group_ranks(weights).items() if r}
            if fetched != dict(ranks):  # not the weights it was registered with (rewritten)
                raise ValueError(f"{name}: ranks {fetched} are not those it was registered with")
            self.buffers.write(rows, weights, progress)
            if self.load_hook is not None:
                self.load_hook(weights)
            meta["adapter"] = weights

        started = time.perf_counter()
        self.loads_started += 1
        handle = self.loader.submit(job)
        self.blocked_seconds += time.perf_counter() - started
        handed_over = progress is not None
        self._inflight[name] = _InFlight(name, slot, ranks, handed_over, handle, started, meta)


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
        # adapter requests by the tier their adapter was in when they arrived (the engine counts)
        self.lookups: dict[str, int] = dict.fromkeys(LOOKUP_TIERS, 0)

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

    def tier(self, name: str) -> str | None:
        """Where `name` is now: "device" (a slot, ready or loading), "host", or "miss" (only
        the source has it); None when requests may not name it (unknown, or unloading).
        Asked from the closest tier out: a resident adapter costs no source lookup."""
        if name in self.unloading:
            return None
        if self.pool.state(name) is not None:
            return "device"
        if self.host_cache.peek(name) is not None:
            return "host"
        return "miss" if name in self.source else None

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
