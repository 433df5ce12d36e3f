"""What an engine tells about itself: counters the step loop keeps, the residency snapshot
the router places requests by, and the telemetry the metrics exporter drains.

Host-side state only: reading it never touches the device or waits for a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replica.adapters.residency import AdapterResidency
from replica.engine.scheduler import Scheduler


@dataclass
class EngineStats:
    idle_on_loads_seconds: float = 0.0  # step loop idle: nothing runnable, loads in flight
    prefetch_seconds: float = 0.0  # step loop bookkeeping: polling, planning, submitting
    steps: int = 0  # steps that ran a batch
    aborted: int = 0  # requests ended by abort() (client gone, deadline) before they finished
    prompt_tokens: int = 0  # prompt tokens computed (prefills; recomputes after preemption too)


class Telemetry:
    def __init__(
        self,
        scheduler: Scheduler,
        adapters: AdapterResidency,
        graph_stats: Callable[[], dict[str, int]],
    ) -> None:
        """`graph_stats`: the executor's (Executor.graph_stats), host counters."""
        self.scheduler, self.adapters, self.graph_stats = scheduler, adapters, graph_stats
        self.stats = EngineStats()

    @property
    def load_wait_seconds(self) -> float:
        """Step-loop time blocked on adapter loads: inside inline loads, or idle because
        nothing could run until a load landed. Bookkeeping is not counted."""
        return self.adapters.load_wait_seconds + self.stats.idle_on_loads_seconds

    def residency(self) -> dict[str, Any]:
        """What the router needs to place requests: adapters on device (READY slots) and in
        host memory, queue depth and free slots; and the leak checks' counts."""
        sched, pool = self.scheduler, self.adapters.pool
        return {
            "device_adapters": self.adapters.device_adapters(),
            "host_adapters": self.adapters.host_cache.names(),
            "num_waiting": len(sched.waiting),
            "num_running": len(sched.running),
            "free_slots": pool.num_free,
            # sized from memory: num_slots - 1 adapters of max_lora_rank fit (more of lower
            # ranks or targeting fewer projection groups); adapter_rows_used of adapter_rows
            # rank rows are held, both summed over the groups' arenas
            "num_slots": pool.max_rank_adapters + 1,
            "adapter_rows": pool.num_rows * len(pool.arenas),
            "adapter_rows_used": pool.rows_used,
            "adapter_loads": self.adapters.prefetcher.loads_started,
            # leak checks (tests/reliability): all blocks free and no slot referenced when idle
            "kv_blocks_free": sched.allocator.num_free,
            "kv_blocks_total": sched.allocator.num_blocks,
            "kv_blocks_cached": sched.allocator.num_cached,  # free ones counted in kv_blocks_free
            "slot_refs": sum(s.refs for s in pool.slots),
            "aborted": self.stats.aborted,
            # fair share (VTC; empty under FCFS), by tenant name ("" = requests without a
            # tenant): each counter, and how far it is above the tenant served next
            "tenant_counters": _by_name(sched.policy.counters()),
            "tenant_lag": _by_name(sched.policy.lags(sched.waiting, sched.running)),
        }

    def drain(self) -> dict[str, Any]:
        """Cumulative counters and current gauges for metrics, plus the latencies of the
        loads finished since the last call (drained: one consumer, the metrics exporter)."""
        pf, stats = self.adapters.prefetcher, self.stats
        latencies = list(pf.recent_load_seconds)
        pf.recent_load_seconds.clear()
        return {
            "slots": self.adapters.pool.occupancy(),
            "lookups": dict(self.adapters.lookups),  # by tier (adapters/residency.py)
            "loads_started": pf.loads_started,
            "loads_done": pf.loads_done,
            "loads_used": self.adapters.pool.num_used_loads,
            "load_wait_seconds": self.load_wait_seconds,
            "preemptions": self.scheduler.num_preemptions,
            "steps": stats.steps,
            "prefix_queried_tokens": self.scheduler.prefix.queried_tokens,
            "prefix_hit_tokens": self.scheduler.prefix.hit_tokens,
            "load_latencies_s": latencies,
            **self.graph_stats(),  # graphs_captured, graph_replays, eager_decode_steps
        }


def _by_name(per_tenant: dict[str | None, float]) -> dict[str, float]:
    return {"" if t is None else t: v for t, v in per_tenant.items()}
