"""Ranks 1..N-1 of a tensor-parallel replica: Ray actors running the steps rank 0 sends.

Each builds its own shard of the model, adapter slots and KV cache from the engine
config, then loops: receive rank 0's step message (one broadcast per step), make the KV
block copies it carries (forks), run the forward (whose collectives pair with rank 0's),
until rank 0 sends None. Adapter loads arrive as separate actor calls, on another thread
of the actor, for slots rank 0 has reserved and no step reads until every rank has
finished loading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from replica.adapters.host_cache import HostCache
from replica.adapters.sharded import ShardedSource
from replica.adapters.sources import AdapterLocator
from replica.config import EngineConfig
from replica.device import (
    SideStreamLoader,
    device_uuid,
    rank_device,
    resolve_dtype,
    use_device,
)
from replica.executor.batch import BatchPlan
from replica.executor.runner import ModelRunner
from replica.model.lora_slots import Rows, SlotTable
from replica.model.spec import load_model_spec
from replica.model.tp_comm import TPComm
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import TPShard


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 broadcasts each step: ModelRunner.execute's arguments, host values, and
    the KV block copies rank 0 made since the last step (forks), done before the forward."""

    plan: BatchPlan
    slots: SlotTable
    all_rows: bool
    copies: tuple[list[int], list[int]] = ([], [])  # (src blocks, dst blocks)


class LocatorRegistry:
    """A rank > 0's view of the adapters: the locators rank 0 sent with its loads."""

    def __init__(self) -> None:
        self._locators: dict[str, AdapterLocator] = {}

    def update(self, name: str, locator: AdapterLocator) -> bool:
        """Record where `name` is; True if that changed (a staged copy is stale)."""
        changed = self._locators.get(name) != locator
        self._locators[name] = locator
        return changed

    def locate(self, name: str) -> AdapterLocator:
        return self._locators[name]


@ray.remote(max_concurrency=4)  # threads: the step loop, adapter loads, queries
class TPWorker:
    def __init__(self, config: dict[str, Any], rank: int, size: int) -> None:
        c = EngineConfig(**config)
        # Ray shows the actor only its own GPU (CUDA_VISIBLE_DEVICES): cuda:0 in every one
        # of its threads, the step loop's and the loads' too
        self.device = device = rank_device(c.device)
        use_device(device)
        shard = TPShard(load_model_spec(c.model), rank, size)
        self.tp = TPRank(shard, TPComm(rank, size, device))
        self.runner = ModelRunner(c, shard.spec, device, resolve_dtype(c.dtype, device), self.tp)
        self.locators = LocatorRegistry()
        self.host_cache = HostCache(ShardedSource(self.locators, shard), c.host_cache_bytes)
        self.loader = SideStreamLoader(device)

    def ready(self) -> dict[str, Any]:
        """Where this rank runs (pid, placement group, its GPU's UUID or None), once its
        shard is built."""
        pg = ray.util.get_current_placement_group()
        return {
            "pid": os.getpid(),
            "placement_group": None if pg is None else pg.id.hex(),
            "device": device_uuid(self.device),
        }

    def join(self, host: str, port: int, timeout_s: float) -> None:
        use_device(self.device)  # the process group's communicator is made on this thread
        self.tp.comm.join(host, port, timeout_s)

    def serve_steps(self) -> int:
        """Run rank 0's steps until it sends None; returns how many ran."""
        steps = 0
        while (msg := self.tp.comm.broadcast_object()) is not None:
            self.runner.copy_blocks(*msg.copies)
            self.runner.execute(msg.plan, msg.slots, msg.all_rows)
            steps += 1
        self.tp.comm.close()
        self.loader.shutdown()
        return steps

    def load(self, rows: Rows, name: str, locator: AdapterLocator, timeout_s: float) -> None:
        """Copy this rank's shard of adapter `name` into each group's arena rows from
        `rows[group]`; returns once it is there."""
        if self.locators.update(name, locator):
            self.host_cache.drop(name)
        weights = self.host_cache.get(name)
        self.loader.submit(lambda: self.runner.lora.write(rows, weights)).wait(timeout_s)

    def slot_weights(
        self, layer: int, group: str, row0: int, rank: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(A [num_slices, rank, in], B [out, rank]) of the adapter at arena rows
        [row0, row0 + rank) of one projection group on this rank, as host arrays."""
        buf, rows = self.runner.lora.layers[layer][group], slice(row0, row0 + rank)
        return buf.a[:, rows].float().cpu().numpy(), buf.b[:, rows].float().cpu().numpy()

    def staged_bytes(self) -> dict[str, int]:
        """Bytes of each adapter shard staged in this rank's host memory."""
        return {n: self.host_cache.get(n).nbytes for n in self.host_cache.names()}
