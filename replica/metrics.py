"""A replica's Prometheus metrics, recorded through Ray's metrics API (Ray's metrics agent
exports them as `ray_lorafleet_replica_*`), from the engine's residency snapshot."""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge


class ReplicaMetrics:
    def __init__(self, replica_id: str) -> None:
        tags = {"replica": replica_id}

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, tag_keys=("replica",)).set_default_tags(tags)

        self.waiting = gauge("lorafleet_replica_waiting_requests", "Requests waiting to run.")
        self.running = gauge("lorafleet_replica_running_requests", "The running batch's size.")
        self.free_slots = gauge("lorafleet_replica_free_adapter_slots", "Empty adapter slots.")
        self.adapter_loads = Counter(
            "lorafleet_replica_adapter_loads",
            "Adapter loads into device slots started.",
            tag_keys=("replica",),
        ).set_default_tags(tags)
        self._loads_seen = 0

    def update(self, snapshot: dict[str, Any]) -> None:
        """From `LLMEngine.residency()`; its `adapter_loads` is cumulative."""
        self.waiting.set(snapshot["num_waiting"])
        self.running.set(snapshot["num_running"])
        self.free_slots.set(snapshot["free_slots"])
        loads = snapshot["adapter_loads"]
        # a count lower than the last one means a new engine: it counts from zero again
        new = loads - self._loads_seen if loads >= self._loads_seen else loads
        if new > 0:
            self.adapter_loads.inc(new)
        self._loads_seen = loads
