"""Rank 0 of a tensor-parallel replica: starts ranks 1..N-1, then drives their steps and loads.

Placement. Every rank computes on a GPU of its own. In a Serve replica deployed with
placement_group_bundles (cluster/app.py derives N bundles from tp_size), the replica
is rank 0 in bundle 0 and rank i an actor in bundle i, taking that bundle's
resources: Ray gives each bundle its own GPU. Anywhere else (lorafleet generate, the
bench, tests) rank 0 uses the engine's own device, outside Ray's accounting, and the
group reserves a placement group of its own with one bundle per rank 1..N-1; a local
Ray it starts is told every GPU but rank 0's (CUDA_VISIBLE_DEVICES), so no rank is
given rank 0's. At join every rank reports its GPU's UUID, and a group with two ranks
on one GPU is refused before any collective (a Ray that was already running may count
rank 0's GPU as free).

Failure. A rank that dies closes its sockets, so rank 0's next collective fails at
once; one whose step raises is killed for the same effect. A watcher thread names
the rank, and from then on every step and health check raises TPRankError: the
Serve replica is restarted (its rank actors die with it, Ray kills actors whose
owner is gone) instead of hanging.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replica.adapters.sharded import ShardedSlotWriter, ShardedSource
from replica.adapters.sources import AdapterLocator
from replica.config import EngineConfig
from replica.device import StepProgress, device_uuid, other_visible_gpus
from replica.executor.base import Executor
from replica.executor.batch import BatchPlan
from replica.executor.runner import ModelRunner
from replica.executor.tp_worker import DROP_GRAPHS, WARM_UP, StepMessage, TPWorker
from replica.model.lora_slots import Rows, SlotTable
from replica.model.spec import load_model_spec
from replica.model.tp_comm import TPComm
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import TPShard

log = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0  # ranks loading their shards of a large model
RESERVE_TIMEOUT_S = 60.0  # devices for the ranks of a group outside Serve
COLLECTIVE_TIMEOUT_S = 300.0  # one collective of a live but stuck peer
LOAD_TIMEOUT_S = 120.0  # one adapter shard into one slot
FAILURE_GRACE_S = 5.0  # after a failed collective, for the watcher to name the rank
STOP_TIMEOUT_S = 30.0
RANK_ACTOR_PREFIX = "lorafleet-tp-"


class TPRankError(RuntimeError):
    """A tensor-parallel rank died or failed: the replica cannot serve any more."""


class TPGroup:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """Use start()."""
        self.size = n = config.tp_size
        # a model that N ranks cannot split fails here, before anything starts
        self.rank = TPRank(TPShard(load_model_spec(config.model), 0, n), TPComm(0, n, device))
        self.workers: list = []
        self._device = device
        self._pg: PlacementGroup | None = None
        self._own_pg = False
        self._runs: list[ray.ObjectRef] = []
        self._failure: str | None = None
        self._closed = False
        self._steps = 0  # steps broadcast so far: the next one's number on every rank
        self.rank_graphs: list[int] = []  # decode graphs ranks 1..N-1 captured (warm_up)

    @classmethod
    def start(
        cls, config: EngineConfig, device: torch.device, build: Callable[[TPRank], T]
    ) -> tuple[TPGroup, T]:
        """Start ranks 1..N-1, `build` rank 0's part meanwhile, then connect them all."""
        if dist.is_initialized():
            raise RuntimeError("this process already holds a tensor-parallel rank")
        group = cls(config, device)
        try:
            group._launch(config, device)
            built = build(group.rank)
            group._connect()
        except BaseException:
            group.shutdown()
            raise
        return group, built

    def _launch(self, config: EngineConfig, device: torch.device) -> None:
        """Start the actors of ranks 1..N-1, which build their shards."""
        if not ray.is_initialized():
            _start_ray(device, self.size)
        self._pg, self._own_pg, placements = _reserve(self.size, device)
        name = f"{RANK_ACTOR_PREFIX}{uuid.uuid4().hex[:8]}-rank"  # findable in `ray list actors`
        self.workers = [
            TPWorker.options(
                name=f"{name}{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=index
                ),
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
            ).remote(config.model_dump(), rank, self.size)
            for rank, (index, resources) in enumerate(placements, start=1)
        ]

    def _connect(self) -> None:
        """Wait for every rank's shard, form the process group, start the ranks' step loops."""
        try:
            ready = ray.get([w.ready.remote() for w in self.workers], timeout=STARTUP_TIMEOUT_S)
        except Exception as e:
            raise TPRankError(f"tensor-parallel ranks failed to start: {e}") from e
        check_distinct_devices([device_uuid(self._device), *(r["device"] for r in ready)])
        try:
            host = ray.util.get_node_ip_address()
            port = self.rank.comm.listen(host, STARTUP_TIMEOUT_S)
            joins = [w.join.remote(host, port, COLLECTIVE_TIMEOUT_S) for w in self.workers]
            self.rank.comm.join(host, port, COLLECTIVE_TIMEOUT_S)
            ray.get(joins, timeout=STARTUP_TIMEOUT_S)
        except Exception as e:
            raise TPRankError(f"tensor-parallel ranks failed to start: {e}") from e
        self._runs = [w.serve_steps.remote() for w in self.workers]
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    # -- steps ---------------------------------------------------------------------------------

    def warm_up(self, runner: ModelRunner) -> None:
        """Every rank warms up (its collectives pair with the others') and captures its
        decode graphs (ModelRunner.warm_up, capture); returns once all have. If some rank
        could not capture them all (out of memory), every rank drops its graphs: all run
        the same kind of step, never a replayed collective against an eager one."""
        self.check()
        try:
            self.rank.comm.broadcast_object(WARM_UP)
            runner.warm_up()
            runner.capture()
            stats = ray.get(
                [w.graph_stats.remote(STARTUP_TIMEOUT_S) for w in self.workers],
                timeout=STARTUP_TIMEOUT_S,
            )
            counts = [runner.graph_stats()["graphs_captured"]]
            counts += [s["graphs_captured"] for s in stats]
            if len(set(counts)) > 1:
                log.warning("decode graphs captured per rank: %s; every rank runs eagerly", counts)
                self.rank.comm.broadcast_object(DROP_GRAPHS)
                runner.drop_graphs()
                counts = [0] * self.size
        except Exception as e:
            raise self._failed(e) from e
        self.rank_graphs = counts[1:]

    def execute(
        self,
        runner: ModelRunner,
        plan: BatchPlan,
        slots: SlotTable,
        all_rows: bool = False,
        copies: tuple[list[int], list[int]] = ([], []),
        progress: StepProgress | None = None,
    ) -> torch.Tensor:
        """Send the step (and the block copies rank 0 made since the last one) to every
        rank, run rank 0's part; the logits of every rank's vocab shard come back gathered.
        `progress` learns the step's number, which the other ranks' slot writes of a
        hand-over wait behind (load_on_ranks)."""
        self.check()
        step, self._steps = self._steps, self._steps + 1
        msg = StepMessage(plan, slots, all_rows, copies, step)
        if progress is not None:
            progress.begin(step)
        try:
            self.rank.comm.broadcast_object(msg)
            return runner.execute(plan, slots, all_rows, progress)
        except Exception as e:
            raise self._failed(e) from e

    # -- adapters ------------------------------------------------------------------------------

    def load_on_ranks(
        self, rows: Rows, name: str, locator: AdapterLocator, after_step: int | None = None
    ) -> list[ray.ObjectRef]:
        """Ranks 1..N-1 start loading their shards of `name` into each group's arena rows
        from `rows[group]` (rank 0's choice), each behind its own step `after_step` (a
        hand-over: that step still reads the rows) when given."""
        return [
            w.load.remote(rows, name, locator, LOAD_TIMEOUT_S, after_step) for w in self.workers
        ]

    def wait_loads(self, pending: list[ray.ObjectRef]) -> None:
        try:
            ray.get(pending, timeout=LOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            # the late rank may still write into the slot after rank 0 reuses it
            late = TimeoutError(f"a rank did not load an adapter within {LOAD_TIMEOUT_S:.0f}s")
            raise self._failed(late) from None
        except ray.exceptions.RayActorError as e:  # the rank is gone, not just this load
            raise self._failed(e) from e

    # -- health --------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise TPRankError if a rank has died or failed."""
        if self._failure is not None:
            raise TPRankError(self._failure)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._runs and self._failure is None:
            try:  # None ends the ranks' step loops
                self.rank.comm.broadcast_object(None)
                ray.get(self._runs, timeout=STOP_TIMEOUT_S)
            except Exception as e:
                log.warning("tensor-parallel ranks did not stop cleanly: %s", e)
        self.rank.comm.close()
        for w in self.workers:
            ray.kill(w)
        if self._own_pg and self._pg is not None:
            remove_placement_group(self._pg)

    def _watch(self) -> None:
        pending = dict(zip(self._runs, range(1, self.size)))
        while pending and not self._closed:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                    error = "its step loop ended"
                except Exception as e:
                    error = _first_line(e)
                if self._closed:
                    return
                self._failure = f"tensor-parallel rank {rank} of {self.size} failed: {error}"
                log.error(self._failure)
                ray.kill(self.workers[rank - 1])  # a live but failed rank: fail the collectives

    def _failed(self, error: Exception) -> TPRankError:
        """The group is broken (a step or load failed): the error to raise, with the
        watcher's diagnosis of which rank failed if it comes in time."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._failure is None:
            self._failure = f"tensor-parallel group failed: {_first_line(error)}"
        return TPRankError(self._failure)


def _start_ray(device: torch.device, size: int) -> None:
    """Start a local Ray for ranks 1..N-1 and rank 0 on `device`: shown every GPU but
    rank 0's, which this process uses outside Ray's accounting (Ray hands an actor the
    first GPU it counts as free, which would otherwise be rank 0's)."""
    if device.type != "cuda":
        ray.init(include_dashboard=False)
        return
    others = other_visible_gpus(device)
    if len(others) < size - 1:
        raise ValueError(
            f"tp_size={size} needs {size} GPUs, one per rank; this process sees {len(others) + 1}"
        )
    with _environ("CUDA_VISIBLE_DEVICES", ",".join(others)):  # read by the Ray it starts
        ray.init(include_dashboard=False)


@contextmanager
def _environ(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def check_distinct_devices(uuids: list[str | None]) -> None:
    """Raise TPRankError naming the ranks that share a GPU (uuids[i]: rank i's; None for
    a CPU, which ranks share by design)."""
    first: dict[str, int] = {}
    for rank, gpu in enumerate(uuids):
        if gpu is None:
            continue
        if gpu in first:
            raise TPRankError(
                f"tensor-parallel ranks {first[gpu]} and {rank} are on one GPU ({gpu}): "
                "each rank needs its own (a Ray started without this process leaves its "
                "GPU to actors: start that Ray with CUDA_VISIBLE_DEVICES naming the others)"
            )
        first[gpu] = rank


def _reserve(
    size: int, device: torch.device
) -> tuple[PlacementGroup, bool, list[tuple[int, dict[str, float]]]]:
    """The placement group of ranks 1..N-1, whether we created it, and each rank's
    (bundle index, resources)."""
    pg = get_current_placement_group()
    if pg is not None:  # a Serve replica, rank 0 in bundle 0: ranks 1..N-1 in bundles 1..N-1
        if pg.bundle_count < size:
            raise ValueError(
                f"tp_size={size} needs a placement group of {size} bundles (one per rank); "
                f"this replica's has {pg.bundle_count}"
            )
        return pg, False, [(i, pg.bundle_specs[i]) for i in range(1, size)]
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if device.type == "cuda" else {})}
    pg = placement_group([bundle] * (size - 1), strategy="PACK")
    if not pg.wait(RESERVE_TIMEOUT_S):
        remove_placement_group(pg)
        raise TimeoutError(
            f"could not reserve {size - 1} x {bundle} for tensor-parallel ranks 1..{size - 1} "
            f"within {RESERVE_TIMEOUT_S:.0f}s; available: {ray.available_resources()}"
        )
    return pg, True, [(i - 1, bundle) for i in range(1, size)]


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel group as the engine's executor."""

    supports_hand_over = True  # each rank's share of a slot waits behind its own step

    def __init__(self, group: TPGroup, runner: ModelRunner) -> None:
        self.group, self.runner = group, runner
        self.model, self.lora, self.num_blocks = runner.model, runner.lora, runner.num_blocks
        self.max_model_len = runner.max_model_len
        self._copies: tuple[list[int], list[int]] = ([], [])  # for ranks 1..N-1, next step
        if runner.device.type == "cuda":
            try:
                group.warm_up(runner)
            except BaseException:
                group.shutdown()
                raise

    def execute(
        self,
        plan: BatchPlan,
        slots: SlotTable,
        all_rows: bool = False,
        progress: StepProgress | None = None,
    ) -> torch.Tensor:
        copies, self._copies = self._copies, ([], [])
        return self.group.execute(self.runner, plan, slots, all_rows, copies, progress)

    def graph_stats(self) -> dict[str, int]:
        """Rank 0's counts (every rank runs every step the same way, a graph or its eager
        forward), with the fewest graphs any rank captured."""
        stats = self.runner.graph_stats()
        stats["graphs_captured"] = min([stats["graphs_captured"], *self.group.rank_graphs])
        return stats

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Rank 0 copies now; the other ranks with the next step's message, before its
        forward: nothing writes or reads their cache in between, and no extra broadcast."""
        self.runner.copy_blocks(src, dst)
        self._copies[0].extend(src)
        self._copies[1].extend(dst)

    def adapter_staging(self, source: Any) -> tuple[ShardedSource, ShardedSlotWriter]:
        """Each rank stages only its shard; slot writes fan out to every rank."""
        staged = ShardedSource(source, self.group.rank.shard)
        return staged, ShardedSlotWriter(self.lora, self.group, source.locate)

    def check_health(self) -> None:
        self.group.check()

    def shutdown(self) -> None:
        self.group.shutdown()
