"""AdapterAffinityRouter: send each request where its adapter already is, within a load bound.

Ranking for an adapter request (each rank is tried in order; Serve picks the
least-loaded replica of a rank that accepts, and moves on if none does):
  1. replicas holding the adapter in a device slot,
  2. replicas holding it in host memory,
  3. the adapter's rendezvous-hash (HRW) order: its home first, then the next,
     stable across calls and reshuffling only the adapters of a replica that
     comes or goes,
  4. every replica (so a request is always routable).
Ranks 1-3 admit only replicas under the load bound of consistent hashing with
bounded loads: load + 1 <= max(floor, ceil((1 + epsilon) * (total load + 1) / replicas)).
The floor keeps affinity when queues are short: a replica batches a few requests
at no cost, while moving them means loading the adapter somewhere else.
Base-model requests need no adapter: least loaded of two random replicas.

Replicas publish residency and queue length through `record_routing_stats`
(up to one period stale); the router also counts the requests it has routed and
not yet seen complete, so a burst sees its own earlier placements. A replica's
load is the larger of the two.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


@dataclass(frozen=True)
class ReplicaView:
    """What routing knows of one replica."""

    id: str
    load: int
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()


def hrw_order(adapter: str, replica_ids: Sequence[str]) -> list[str]:
    """Rendezvous hashing: replicas by descending hash(adapter, replica)."""

    def score(rid: str) -> int:
        digest = hashlib.blake2b(f"{adapter}\0{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(replica_ids, key=score, reverse=True)


def rank_for_adapter(
    adapter: str, replicas: Sequence[ReplicaView], epsilon: float, floor: int = 0
) -> list[list[str]]:
    """Ranked replica ids for a request of `adapter` (see the module docstring)."""
    if not replicas:
        return []
    total = sum(r.load for r in replicas)
    bound = max(floor, math.ceil((1 + epsilon) * (total + 1) / len(replicas)))
    ok = {r.id: r for r in replicas if r.load + 1 <= bound}

    def by_load(views: list[ReplicaView]) -> list[str]:
        return [r.id for r in sorted(views, key=lambda r: r.load)]

    ranks = [
        by_load([r for r in ok.values() if adapter in r.device_adapters]),
        by_load([r for r in ok.values() if adapter in r.host_adapters]),
        *([rid] for rid in hrw_order(adapter, list(ok))),
        by_load(list(replicas)),
    ]
    return [rank for rank in ranks if rank]


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, load_bound_epsilon: float = 0.25, load_bound_floor: int = 4) -> None:
        self.epsilon = load_bound_epsilon
        self.floor = load_bound_floor
        self._in_flight: dict[str, set[str]] = {}  # replica id -> internal request ids

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._in_flight.setdefault(replica_id.unique_id, set()).add(request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else []
        adapter = args[0] if args else None
        if adapter is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        return [
            [by_id[i] for i in rank]
            for rank in rank_for_adapter(adapter, views, self.epsilon, self.floor)
        ]

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        load = max(len(self._in_flight.get(rid, ())), int(stats.get("queue_len", 0)))
        return ReplicaView(
            rid,
            load,
            frozenset(stats.get("device_adapters", ())),
            frozenset(stats.get("host_adapters", ())),
        )
