"""S-LoRA prefetch: look at the first W waiting requests and start loading their adapters.

Per adapter: NOT_LOADED -> LOADING (slot reserved, copy in flight on the loader)
-> LOADED (slot READY). Every step drains finished loads with a non-blocking
poll before the scheduler looks at slot readiness.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from replica.adapters.host_cache import HostCache
from replica.adapters.slot_pool import AdapterSlotPool
from replica.device import LoadHandle, StepProgress, wait_any
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.lora_slots import LoRASlotBuffers


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
