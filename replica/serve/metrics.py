"""A replica's Prometheus metrics, recorded through Ray's metrics API (Ray's metrics agent
exports them as `ray_lorafleet_replica_*`), from the engine's residency snapshot and its
telemetry (`LLMEngine.residency`, `LLMEngine.drain_telemetry`), once per stats period."""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

# Seconds: a small adapter copied on a GPU up to a large one read from disk on a busy CPU.
LOAD_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]


class _Cumulative:
    """A Ray Counter fed with the engine's own running totals: increments by the change.
    A total lower than the last one means a new engine, which counts from zero again."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last: dict[tuple, float] = {}

    def set_total(self, total: float, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        if key not in self._last and total == 0:
            # Ray exports a counter only once it holds a value, and inc() refuses 0: record
            # the zero itself, so that a counter the docs list exists from the start
            self.counter._record(0.0, tags=tags)
        last = self._last.get(key, 0)
        new = total - last if total >= last else total
        if new > 0:
            self.counter.inc(new, tags=tags)
        self._last[key] = total


class ReplicaMetrics:
    def __init__(self, replica_id: str) -> None:
        tags = {"replica": replica_id}

        def gauge(name: str, description: str, keys: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, description, tag_keys=("replica", *keys)).set_default_tags(tags)

        def total(name: str, description: str, keys: tuple[str, ...] = ()) -> _Cumulative:
            counter = Counter(name, description, tag_keys=("replica", *keys))
            return _Cumulative(counter.set_default_tags(tags))

        self.waiting = gauge("lorafleet_replica_waiting_requests", "Requests waiting to run.")
        self.running = gauge("lorafleet_replica_running_requests", "The running batch's size.")
        self.slots = gauge(
            "lorafleet_replica_adapter_slots",
            "Adapter slots (the base slot aside) by state: free, loading, ready.",
            ("state",),
        )
        self.lookups = total(
            "lorafleet_replica_adapter_lookups",
            "Adapter requests by where their adapter was on arrival: device (a slot, ready "
            "or loading), host (host memory only) or miss; hit rates are their shares.",
            ("tier",),
        )
        self.loads = total("lorafleet_replica_adapter_loads", "Adapter loads into slots started.")
        self.loads_used = total(
            "lorafleet_replica_adapter_loads_used",
            "Adapter loads (all are prefetches when loading overlaps) that some request ran "
            "on before eviction: useful prefetches.",
        )
        self.load_wait = total(
            "lorafleet_replica_load_wait_seconds",
            "Step-loop time blocked on adapter loads (nothing else could run).",
        )
        self.preemptions = total(
            "lorafleet_replica_preemptions", "Sequences preempted for KV space (recomputed later)."
        )
        self.steps = total("lorafleet_replica_steps", "Engine steps that ran a batch.")
        self.prefix_queried = total(
            "lorafleet_replica_prefix_cache_queried_tokens",
            "Tokens of requests looked up in the prefix cache on admission.",
        )
        self.prefix_hits = total(
            "lorafleet_replica_prefix_cache_hit_tokens",
            "Of the queried tokens, those found cached (not prefilled again); the hit rate "
            "is hit / queried.",
        )
        self.kv_cached = gauge(
            "lorafleet_replica_kv_blocks_cached",
            "KV blocks holding a cached prefix (referenced or evictable).",
        )
        self.load_latency = Histogram(
            "lorafleet_replica_adapter_load_seconds",
            "From the start of an adapter load to its slot being ready.",
            boundaries=LOAD_BUCKETS_S,
            tag_keys=("replica",),
        ).set_default_tags(tags)

    def update(self, residency: dict[str, Any], telemetry: dict[str, Any]) -> None:
        """From `LLMEngine.residency()` and `LLMEngine.drain_telemetry()`."""
        self.waiting.set(residency["num_waiting"])
        self.running.set(residency["num_running"])
        for state, n in telemetry["slots"].items():
            self.slots.set(n, tags={"state": state})
        for tier, n in telemetry["lookups"].items():
            self.lookups.set_total(n, {"tier": tier})
        self.loads.set_total(telemetry["loads_started"])
        self.loads_used.set_total(telemetry["loads_used"])
        self.load_wait.set_total(telemetry["load_wait_seconds"])
        self.preemptions.set_total(telemetry["preemptions"])
        self.steps.set_total(telemetry["steps"])
        self.prefix_queried.set_total(telemetry["prefix_queried_tokens"])
        self.prefix_hits.set_total(telemetry["prefix_hit_tokens"])
        self.kv_cached.set(residency["kv_blocks_cached"])
        for seconds in telemetry["load_latencies_s"]:
            self.load_latency.observe(seconds)
