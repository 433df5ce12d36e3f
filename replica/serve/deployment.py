"""LoRAReplica: the Ray Serve deployment around one replica's engine.

The ingress calls `generate(request)` (a wire.GenerateRequest, whose adapter the
request router reads) through a DeploymentHandle; the request goes on, as it is, to the
engine, and its wire.Replies come back as the engine makes them (a list per message). The
replica owns the request's deadline (`timeout_s`). A caller that gives up cancels its call
(DeploymentResponseGenerator.cancel): Serve raises CancelledError in `generate`, which
aborts the request here, freeing its KV blocks and adapter slot reference. Adapter
weights come from the object store; this class only asks the AdapterStore where an
AdapterKey's weights are, once per version, and publishes what is resident for routing
(wire.RoutingStats). Nothing here speaks HTTP: a refusal is an exception of
replica/errors.py, which the ingress maps to its status.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from replica.adapters.object_store import ObjectStoreSource
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.errors import DeadlineExceeded, NotFound, Unavailable
from replica.serve.async_engine import AsyncLLMEngine
from replica.serve.metrics import ReplicaMetrics
from replica.wire import (
    AdapterKey,
    AdapterWeightsRef,
    GenerateRequest,
    RegistryEpoch,
    Reply,
    ReportReply,
    RoutingStats,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

STORE_TIMEOUT_S = 10.0
# How long a version the store removed is remembered: a fetch of it that crosses the
# report announcing the removal (the store serves removed versions for 60 s) still
# gets dropped.
REMOVED_MEMORY_S = 180.0


class LoRAReplica:
    def __init__(self, engine_config: dict[str, Any], store: DeploymentHandle) -> None:
        """`store` is a DeploymentHandle to the AdapterStore."""
        _use_assigned_cpus()
        self.source = ObjectStoreSource()
        self.engine = LLMEngine(EngineConfig(**engine_config), source=self.source)
        self.aengine = AsyncLLMEngine(self.engine)
        self.store = store
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.metrics = ReplicaMetrics(self.replica_id)
        self._fetching: dict[str, asyncio.Future] = {}
        self._store_epoch: RegistryEpoch | None = None  # of the store's last answer
        self._removed: dict[str, float] = {}  # adapter key -> when the store removed it

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[Reply]]:
        """Yields the request's replies as the engine makes them: each message holds every
        step's since the last (one reply per choice with news per step), in order.

        Raises NotFound for an adapter version the store no longer has, RequestError for
        a request the engine cannot serve, Unavailable when the store cannot be reached or
        the generation failed, and DeadlineExceeded once `timeout_s` has passed (the
        request aborted then: KV and slot freed at once). A caller that cancels
        (CancelledError, wherever it lands) aborts the request too."""
        now = asyncio.get_running_loop().time()
        deadline = None if request.timeout_s is None else now + request.timeout_s
        if request.adapter is not None:
            await _by(deadline, self._ensure_adapter(request.adapter))
        stream = self.aengine.add_request(request)
        try:
            while (replies := await _by(deadline, stream.next())) is not None:
                yield replies
        finally:
            if not stream.finished:  # the caller went away, or the deadline passed
                self.aengine.abort(stream)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Published to the request router every `request_routing_stats_period_s`; the
        same snapshot updates the replica's Prometheus metrics."""
        snapshot, telemetry = await self.aengine.call(
            lambda: (self.engine.residency(), self.engine.drain_telemetry())
        )
        self.metrics.update(snapshot, telemetry)
        stats = RoutingStats(
            device_adapters=frozenset(
                AdapterKey.parse(k).name for k in snapshot["device_adapters"]
            ),
            host_adapters=frozenset(AdapterKey.parse(k).name for k in snapshot["host_adapters"]),
            queue_len=snapshot["num_waiting"] + snapshot["num_running"],
            free_slots=snapshot["free_slots"],
            tenant_lag=snapshot["tenant_lag"],
        ).to_dict()
        memory = {"rss_bytes": _rss_bytes()}
        counters = {k: v for k, v in telemetry.items() if k not in ("load_latencies_s", "slots")}
        slots = slot_report(snapshot, telemetry["slots"])
        await self._report({**snapshot, **stats, **memory, **slots, "telemetry": counters})
        return stats

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop or a tensor-parallel rank has died."""
        if not self.aengine.is_alive():
            raise RuntimeError("engine loop is not running")
        self.engine.check_health()

    async def residency(self) -> dict[str, Any]:
        return await self.aengine.call(self.engine.residency)

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()

    # -- adapters ------------------------------------------------------------------------------

    async def _ensure_adapter(self, adapter: AdapterKey) -> str:
        """The engine's key of one adapter version, asking the store where its weights are
        (and its ranks per group) on first use. Concurrent first requests for one version
        share one fetch."""
        key = str(adapter)
        if key in self.source:
            return key
        pending = self._fetching.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_ref(adapter))
            self._fetching[key] = pending
            pending.add_done_callback(lambda _: self._fetching.pop(key, None))
        await asyncio.shield(pending)
        return key

    async def _fetch_ref(self, adapter: AdapterKey) -> None:
        try:
            stored: AdapterWeightsRef = await self.store.get_weights.remote(adapter)
        except NotFound as e:  # the store's NotFoundError is one (router/errors.py)
            raise NotFound(e.message) from None
        except Exception as e:
            reason = getattr(e, "cause", e)  # a RayTaskError: what the store raised
            raise Unavailable(f"the adapter store failed for {adapter}: {reason!r}") from None
        self.source.add(stored)

    async def _report(self, stats: dict[str, Any]) -> None:
        """Report to the store; drop references to adapter versions it no longer holds.
        The store answers with the versions removed since the epoch we last saw, or with
        every live version when it cannot tell (a restarted store, a replica far behind)."""
        try:
            reply: ReportReply = await asyncio.wait_for(
                self.store.report_replica.remote(self.replica_id, stats, self._store_epoch),
                STORE_TIMEOUT_S,
            )
        except Exception as e:  # the store restarting must not break routing stats
            log.warning("adapter store unreachable: %s", e)
            return
        self._store_epoch = reply.epoch
        now = time.monotonic()
        self._removed = {k: t for k, t in self._removed.items() if now - t < REMOVED_MEMORY_S}
        self._removed.update(dict.fromkeys(map(str, reply.removed), now))
        stale = {key for key in self._removed if key in self.source}
        if reply.live is not None:
            live = reply.live
            held = map(AdapterKey.parse, self.source.names())
            stale.update(str(a) for a in held if live.get(a.name) != a.version)
        for key in stale:
            await self.aengine.call(lambda key=key: self.engine.unload_adapter(key))


def slot_report(residency: dict[str, Any], occupancy: dict[str, int]) -> dict[str, Any]:
    """Adapter slots as /v1/lorafleet/stats shows them, in counts that add up. A slot is
    room for one adapter of max_lora_rank (num_slots of them, the base model's slot 0
    included); adapters of lower ranks share one, so adapters and slots are counted apart:
    `slots` {base, free, used} sums to num_slots, and `adapters_on_device` {ready, loading}
    counts the adapters held in the `used` slots."""
    free = residency["free_slots"]
    used = residency["num_slots"] - 1 - free
    return {
        "slots": {"base": 1, "free": free, "used": used},
        "adapters_on_device": {
            "ready": occupancy.get("ready", 0),
            "loading": occupancy.get("loading", 0),
        },
    }


def _use_assigned_cpus() -> int:
    """torch's intra-op threads = the CPUs Ray assigned this replica (ray_actor_options
    num_cpus; at least 1): a replica given N CPUs computes on N cores, and replicas
    sharing a node do not oversubscribe it."""
    assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    threads = max(1, math.floor(assigned))
    torch.set_num_threads(threads)
    log.info("engine compute threads: %d (assigned CPUs: %s)", threads, assigned)
    return threads


async def _by(deadline: float | None, awaitable: Awaitable[T]) -> T:
    """What `awaitable` gives, or DeadlineExceeded once the request's deadline (the event
    loop's time; None: no deadline) has passed. Unlike wait_for's, a cancellation (the
    caller gone) is never lost when the awaitable finishes at the same moment."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except TimeoutError:
        raise DeadlineExceeded("the request did not finish within its time limit") from None


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere): the soak test's leak check."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
