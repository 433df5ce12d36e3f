"""Ranks 1..N-1 of a tensor-parallel replica: Ray actors running the steps rank 0 sends.

Each builds its own shard of the model, adapter slots and KV cache from the engine
config, then loops: receive rank 0's step message (one broadcast per step), make the KV
block copies it carries (forks), run the forward (whose collectives pair with rank 0's),
until rank 0 sends None. On CUDA the first message is WARM_UP: every rank warms up and
captures its decode graphs at once (then DROP_GRAPHS if some rank could not). Adapter
loads arrive as separate actor calls, on another thread of the actor, for slots rank 0
has reserved and no step reads until every rank has finished loading; a slot handed over
during step n (its last sequences still read it) is written only behind this rank's own
step n.
"""

from __future__ import annotations

import os
import threading
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
    StepClock,
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
    step: int = 0  # the step's number, counted by rank 0 from 0


WARM_UP = "warm-up"  # rank 0's first message on CUDA: warm up and capture, all ranks at once
DROP_GRAPHS = "drop-graphs"  # after WARM_UP, if some rank captured fewer graphs than another


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
        source = ShardedSource(self.locators, shard)
        self.host_cache = HostCache(source, c.adapters.host_cache_bytes)
        self.loader = SideStreamLoader(device)
        self.clock = StepClock(device)  # the steps issued, for hand-over writes
        self._warmed = threading.Event()
        self._warm_error: BaseException | None = None

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
            if msg == WARM_UP:
                self._warm_up()
                continue
            if msg == DROP_GRAPHS:
                self.runner.drop_graphs()
                continue
            self.runner.copy_blocks(*msg.copies)
            self.runner.execute(msg.plan, msg.slots, msg.all_rows)
            self.clock.issued(msg.step)
            steps += 1
        self.tp.comm.close()
        self.loader.shutdown()
        return steps

    def graph_stats(self, timeout_s: float) -> dict[str, int]:
        """This rank's ModelRunner.graph_stats, once its warm-up and capture are done."""
        if not self._warmed.wait(timeout_s):
            raise TimeoutError(f"rank {self.tp.shard.rank} did not warm up within {timeout_s}s")
        if self._warm_error is not None:
            raise RuntimeError(f"rank {self.tp.shard.rank} failed to warm up") from self._warm_error
        return self.runner.graph_stats()

    def _warm_up(self) -> None:
        try:
            self.runner.warm_up()
            self.runner.capture()
        except BaseException as e:
            self._warm_error = e
            raise
        finally:
            self._warmed.set()

    def load(
        self,
        rows: Rows,
        name: str,
        locator: AdapterLocator,
        timeout_s: float,
        after_step: int | None = None,
    ) -> None:
        """Copy this rank's shard of adapter `name` into each group's arena rows from
        `rows[group]`, behind this rank's step `after_step` when given (a hand-over);
        returns once it is there."""
        if self.locators.update(name, locator):
            self.host_cache.drop(name)
        weights = self.host_cache.get(name)

        def write() -> None:
            if after_step is not None:
                self.clock.wait(after_step, timeout_s)
            self.runner.lora.write(rows, weights)

        self.loader.submit(write).wait(timeout_s)

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
