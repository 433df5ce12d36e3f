"""AdapterAffinityRouter: send each request where its adapter already is, within a load bound.

Ranking for an adapter request (Serve takes the first rank with a replica that
accepts, the least loaded if a rank holds several):
  1. every replica holding the adapter in a device slot, as one rank;
  2. then, one replica per rank, those holding it in host memory, then all others,
     each group in the adapter's rendezvous-hash (HRW) order: its home first, stable
     across calls and reshuffling only the adapters of a replica that comes or goes;
  3. a last rank of every replica, so a request is always routable.
Ranks 1-2 admit only replicas under the load bound of consistent hashing with
bounded loads: load + 1 <= max(floor, ceil((1 + epsilon) * (total load + 1) / replicas)).

Why the tiers differ: a device copy is what saves a load, and an adapter hot enough to
have spilled to a second replica is worth a slot on both, so its device holders share
its requests by load. Host memory is large (on CPU every replica soon holds most
adapters there), so host holders are taken in hash order: by load they would scatter
every cold adapter over every replica's slots. The floor keeps affinity when queues
are short: a replica batches a few requests at no cost, while moving them means
loading the adapter somewhere else.

Prefixes (replicas cache the K/V of prompt prefixes per adapter version): a request's
prefix key hashes its model and its first `prefix_affinity_tokens` prompt tokens (a
shared system prompt, a conversation's start). A base-model request with a key goes to
the key's HRW home within the load bound, then the next in that order, so requests
sharing a prefix find it cached; without one (a short prompt, or the option at 0), the
less loaded of two random replicas. An adapter request with a key takes the replicas
holding its adapter on device in the key's HRW order, one rank each, so a hot adapter on
several replicas keeps each prefix on one of them.

The prefix key also hashes the request's tenant and cache_salt (wire.cache_scope) when it
has either, as the replicas' prefix cache does: tenants never share cached prefixes, so
they need not share a home either.

Tenants (fair share): a replica under VTC publishes, per tenant, how far its counter is
above that of the tenant it serves next (wire.RoutingStats.tenant_lag). Affinity and the
load bound decide as above; where a rank's least loaded replicas tie on load, those
where the request's tenant lags least (is served soonest) come first, as a rank of
their own before the rest of that rank.

Replicas publish residency and queue length through `record_routing_stats` (a
wire.RoutingStats, up to one period stale); the router also counts the requests it
has routed and not yet seen complete, so a burst sees its own earlier placements. A
replica's load is the larger of the two. The adapter of a request is that of the
wire.GenerateRequest the ingress passed to `LoRAReplica.generate`.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util.metrics import Counter

from replica.wire import GenerateRequest, RoutingStats, cache_scope

MAX_REMEMBERED_DECISIONS = 10_000


@dataclass(frozen=True)
class ReplicaView:
    """What routing knows of one replica."""

    id: str
    load: int
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    free_slots: int = 0  # adapter slots holding nothing: a load there evicts no one
    # per tenant ("" = none): its fair-share counter above the next served one's there
    tenant_lag: Mapping[str, float] = field(default_factory=dict, hash=False)


def hrw_order(adapter: str, replica_ids: Sequence[str]) -> list[str]:
    """Rendezvous hashing: replicas by descending hash(adapter, replica)."""

    def score(rid: str) -> int:
        digest = hashlib.blake2b(f"{adapter}\0{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(replica_ids, key=score, reverse=True)


def prefix_key(request: GenerateRequest, tokens: int) -> str | None:
    """The request's model (adapter version or base), its cache scope (tenant and
    cache_salt, when it has either) and its first `tokens` prompt token ids, hashed; None
    when the prompt is shorter (or tokens is 0: prefix affinity off)."""
    if tokens <= 0 or len(request.prompt_ids) < tokens:
        return None
    model = "" if request.adapter is None else str(request.adapter)
    scope = cache_scope(request.tenant, request.cache_salt)
    if scope:
        model += f"\0{scope}"
    data = f"{model}\0{request.prompt_ids[:tokens]}".encode()
    return "prefix:" + hashlib.blake2b(data, digest_size=8).hexdigest()


def _under_bound(replicas: Sequence[ReplicaView], epsilon: float, floor: int) -> list[ReplicaView]:
    """Replicas a request may go to by preference: load + 1 within the bound."""
    total = sum(r.load for r in replicas)
    bound = max(floor, math.ceil((1 + epsilon) * (total + 1) / len(replicas)))
    return [r for r in replicas if r.load + 1 <= bound]


def rank_for_prefix(
    key: str, replicas: Sequence[ReplicaView], epsilon: float, floor: int = 0
) -> list[list[str]]:
    """Ranked replica ids for a base-model request with a prefix key: those under the load
    bound in the key's HRW order, one per rank, then every replica."""
    if not replicas:
        return []
    ok = [r.id for r in _under_bound(replicas, epsilon, floor)]
    everyone = [r.id for r in sorted(replicas, key=lambda r: r.load)]
    return [*([rid] for rid in hrw_order(key, ok)), everyone]


def rank_for_adapter(
    adapter: str,
    replicas: Sequence[ReplicaView],
    epsilon: float,
    floor: int = 0,
    prefix: str | None = None,
) -> list[list[str]]:
    """Ranked replica ids for a request of `adapter` (see the module docstring); with a
    prefix key, the device holders one rank each in the key's HRW order."""
    if not replicas:
        return []
    ok = {r.id: r for r in _under_bound(replicas, epsilon, floor)}
    device = [
        r.id for r in sorted(ok.values(), key=lambda r: r.load) if adapter in r.device_adapters
    ]
    device_ranks = [device] if prefix is None else [[rid] for rid in hrw_order(prefix, device)]
    home = {rid: i for i, rid in enumerate(hrw_order(adapter, list(ok)))}

    def cost(rid: str) -> tuple[bool, bool, int]:  # what a load there costs, then HRW order
        r = ok[rid]
        return r.free_slots <= 0, adapter not in r.host_adapters, home[rid]

    others = sorted((rid for rid in ok if rid not in device), key=cost)
    everyone = [r.id for r in sorted(replicas, key=lambda r: r.load)]
    return [rank for rank in [*device_ranks, *([rid] for rid in others), everyone] if rank]


def break_load_ties(
    ranks: list[list[str]], views: Sequence[ReplicaView], tenant: str
) -> list[list[str]]:
    """`ranks` with each rank whose least loaded replicas differ in `tenant`'s lag split
    in two: those of them where it lags least, then the rest of the rank. Ranks where
    the lag decides nothing (one replica, one lag among the least loaded) stay whole."""
    by_id = {v.id: v for v in views}
    out = []
    for rank in ranks:
        least = min((by_id[r].load for r in rank if r in by_id), default=None)
        tied = [r for r in rank if r in by_id and by_id[r].load == least]
        lags = {r: by_id[r].tenant_lag.get(tenant, 0.0) for r in tied}
        first = [r for r in tied if lags[r] == min(lags.values())]
        if len(first) == len(tied):
            out.append(rank)
        else:
            out += [first, [r for r in rank if r not in first]]
    return out


def routing_reason(adapter: str | None, views: Sequence[ReplicaView], chosen: str) -> str:
    """Why a request went to `chosen`, as the views at decision time show it: base; spill
    when `chosen` was not its first choice (that one was over the load bound, or full);
    else what made the first choice: device (resident in a slot), host (in host memory),
    free_slot (a slot holding nothing) or home (its hash home)."""
    if adapter is None:
        return "base"
    by_id = {v.id: v for v in views}
    unbounded = rank_for_adapter(adapter, views, 0.0, floor=sys.maxsize)
    if chosen not in by_id or chosen not in unbounded[0]:
        return "spill"
    view = by_id[chosen]
    if adapter in view.device_adapters:
        return "device"
    if adapter in view.host_adapters:
        return "host"
    if view.free_slots > 0:
        return "free_slot"
    return "home"


class PlacementMemory:
    """Where this router sent each adapter in the last `memory_s` seconds.

    Replica stats are up to a period old. Until they show it, an adapter just sent to a
    replica counts as on its device there (it is being loaded), and as taking one of the
    free slots the stats reported, so a burst neither scatters one adapter's requests
    nor sends more new adapters to a replica than it has free slots."""

    def __init__(self, memory_s: float) -> None:
        self.memory_s = memory_s
        self._sent: dict[str, dict[str, float]] = {}  # replica id -> adapter -> when

    def record(self, replica_id: str, adapter: str, now: float) -> None:
        self._sent.setdefault(replica_id, {})[adapter] = now

    def forget(self, replica_id: str) -> None:
        self._sent.pop(replica_id, None)

    def view(self, stats: ReplicaView, now: float) -> ReplicaView:
        """The stats' view of a replica with recent placements added."""
        sent = self._sent.get(stats.id, {})
        for adapter in [a for a, t in sent.items() if now - t > self.memory_s]:
            del sent[adapter]  # the stats have had time to show it (or its eviction)
        new = sent.keys() - stats.device_adapters
        if not new:
            return stats
        return replace(
            stats,
            device_adapters=stats.device_adapters | new,
            free_slots=max(0, stats.free_slots - len(new)),
        )


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(
        self,
        load_bound_epsilon: float = 0.25,
        load_bound_floor: int = 4,
        placement_memory_s: float = 2.0,
        prefix_affinity_tokens: int = 0,
    ) -> None:
        self.epsilon = load_bound_epsilon
        self.floor = load_bound_floor
        self.prefix_tokens = prefix_affinity_tokens
        self._in_flight: dict[str, set[str]] = {}  # replica id -> internal request ids
        self._placed = PlacementMemory(placement_memory_s)
        # internal request id -> (adapter, views) of its latest ranking, until it is routed
        self._decisions: OrderedDict[str, tuple[str | None, list[ReplicaView]]] = OrderedDict()
        self._reasons = Counter(
            "lorafleet_routing_decisions",
            "Requests routed, by the replica chosen and why: base, device, host, free_slot, "
            "home, spill (see router.affinity.routing_reason).",
            tag_keys=("replica", "reason"),
        )

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        rid = replica_id.unique_id
        self._in_flight.setdefault(rid, set()).add(request_id)
        adapter, views = self._decisions.pop(request_id, (None, []))
        self._reasons.inc(tags={"replica": rid, "reason": routing_reason(adapter, views, rid)})
        if adapter is not None:
            self._placed.record(rid, adapter, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id.unique_id, None)
        self._placed.forget(replica_id.unique_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _request_of(pending_request)
        adapter = None if request is None or request.adapter is None else request.adapter.name
        key = None if request is None else prefix_key(request, self.prefix_tokens)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        if adapter is None:
            if key is None:
                ranks = [random.sample(list(by_id), min(2, len(by_id)))]
            else:
                ranks = rank_for_prefix(key, views, self.epsilon, self.floor)
        else:
            now = time.monotonic()
            views = [self._placed.view(v, now) for v in views]
            self._remember(pending_request, adapter, views)
            ranks = rank_for_adapter(adapter, views, self.epsilon, self.floor, key)
        if request is not None:
            ranks = break_load_ties(ranks, views, request.tenant or "")
        return [[by_id[i] for i in rank] for rank in ranks]

    def _remember(
        self, pending: PendingRequest | None, adapter: str, views: list[ReplicaView]
    ) -> None:
        """Keep the ranking's inputs until the request is routed (to count its reason)."""
        if pending is None:
            return
        self._decisions[pending.metadata.internal_request_id] = (adapter, views)
        while len(self._decisions) > MAX_REMEMBERED_DECISIONS:  # requests cancelled unrouted
            self._decisions.popitem(last=False)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = RoutingStats.from_dict(replica.routing_stats)
        rid = replica.replica_id.unique_id
        load = max(len(self._in_flight.get(rid, ())), stats.queue_len)
        return ReplicaView(
            rid, load, stats.device_adapters, stats.host_adapters, stats.free_slots,
            stats.tenant_lag,
        )  # fmt: skip


def _request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest of a generate call; None for calls that are not generations
    (they need no affinity)."""
    args = pending.args if pending is not None else ()
    if args and isinstance(args[0], GenerateRequest):
        return args[0]
    return None
