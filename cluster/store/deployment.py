"""AdapterStore: the cluster's registry of LoRA adapters, weights kept in Ray's object store.

One per application (a Serve deployment of one replica, so the controller health-checks
and restarts it), made of parts with one job each: the registry (registry.py: names,
versions, register / resolve, with paths.py and conversion.py), its checkpoint
(checkpoint.py: what a restarted store lists at once) and the replica reports
(reports.py). Weights enter the object store once per cluster, however many replicas use
them: replicas ask for the weights of the version a request names and map them zero-copy.

The ingress lists the registry once per stats period (`listing`, which sends the list
only when its tag changed) and resolves names from that; it calls `resolve` only for a
name its listing lacks. No request is cancelled through here: the ingress cancels its
handle call, which reaches the replica that runs it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ray import serve

from cluster.resolvers import AdapterResolver
from cluster.store.checkpoint import Checkpoint
from cluster.store.conversion import Converter
from cluster.store.paths import AdapterRoots
from cluster.store.registry import Registry
from cluster.store.reports import ReplicaReports
from replica.wire import (
    AdapterInfo,
    AdapterKey,
    AdapterWeightsRef,
    Listing,
    RegistryEpoch,
    ReportReply,
)


class AdapterStore:
    # Every method is async: Serve runs a deployment's sync methods on a thread pool, where
    # they would read the registry while a change on the event loop alters it.

    def __init__(
        self,
        *,
        model: str,
        max_lora_rank: int,
        adapter_roots: list[str],
        preload: dict[str, str],
        reserved_names: tuple[str, ...] = (),
        max_adapter_bytes: int | None = None,
        checkpoint: bool = False,
        resolvers: Sequence[AdapterResolver] = (),
        resolve_allow: Sequence[str] = ("*",),
        lora_embeddings: bool = False,
        lora_experts: bool = False,
    ) -> None:
        """`checkpoint`: keep the registry in a checkpoint actor named after the Serve
        application (off: a restart loses runtime loads). `resolvers`, tried in order
        for names nobody registered whose name matches a `resolve_allow` glob;
        `lora_embeddings`, `lora_experts`, the engine's: adapters it cannot serve are
        refused."""
        incarnation = uuid.uuid4().hex
        self.reports = ReplicaReports(incarnation)
        converter = Converter(
            model, max_lora_rank, reserved_names, max_adapter_bytes, lora_embeddings, lora_experts
        )
        self.registry = Registry(
            converter,
            AdapterRoots(adapter_roots),
            preload,
            Checkpoint(checkpoint_name()) if checkpoint else None,
            resolvers,
            resolve_allow,
            incarnation,
            self.reports.removed,
        )

    async def register(
        self, name: str, path: str, inplace: bool = False, roots: list[str] | None = None
    ) -> AdapterInfo:
        """See Registry.register: a new version of `name` from directory `path`."""
        return await self.registry.register(name, path, inplace, roots)

    async def unregister(self, name: str) -> AdapterInfo:
        return await self.registry.unregister(name)

    async def resolve(self, name: str) -> AdapterInfo:
        """The registered adapter `name`, or what the resolvers find (NotFoundError: why)."""
        return await self.registry.resolve(name)

    async def get_weights(self, key: AdapterKey) -> AdapterWeightsRef:
        return await self.registry.weights(key)

    async def listing(self, known: str | None = None) -> Listing:
        """Every registered adapter, or only the tag when `known` is it already: GET
        /v1/models and the ingress's name cache with 10,000 adapters cost a small call,
        not 10,000 entries pickled, while nothing changes."""
        return self.registry.listing(known)

    async def report_replica(
        self, replica_id: str, stats: dict[str, Any], seen: RegistryEpoch | None = None
    ) -> ReportReply:
        """A replica's periodic report; the answer says which adapter versions to drop."""
        return self.reports.report(replica_id, stats, seen, self.registry)

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        return self.reports.latest()

    async def stats(self) -> dict[str, int]:
        registry, checkpoint = self.registry, self.registry.checkpoint
        return {
            "num_adapters": len(registry),
            "num_puts": registry.num_puts,
            "num_ref_requests": registry.num_ref_requests,
            "num_restored": registry.num_restored,
            "num_resolved": registry.num_resolved,
            "num_checkpoint_writes": 0 if checkpoint is None else checkpoint.num_writes,
        }


def checkpoint_name() -> str:
    """The checkpoint actor's name: one per Serve application."""
    return f"adapter-registry/{serve.get_replica_context().app_name}"
