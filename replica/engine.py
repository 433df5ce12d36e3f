"""The engine of one replica: schedule -> prepare -> forward -> sample -> emit.

Single-threaded: the caller (AsyncLLMEngine's loop thread, or an offline
loop) owns it. Adapter loads run on the loader, overlapped with steps.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.adapter_format import LoRAAdapterWeights, SelectLoRA
from replica.batch import plan_batch
from replica.config import EngineConfig
from replica.device import (
    InlineLoader,
    SideStreamLoader,
    StepProgress,
    resolve_device,
    resolve_dtype,
)
from replica.eviction import make_policy
from replica.host_cache import AdapterLocator, AdapterSource, HostCache, PeftDirectorySource
from replica.kv_cache import BlockAllocator, blocks_needed
from replica.model_config import load_model_spec
from replica.model_runner import ModelRunner
from replica.parallel.adapters import ShardedSlotWriter, ShardedSource
from replica.parallel.group import TPExecutor, TPGroup
from replica.parallel.layers import TPRank
from replica.prefetcher import Prefetcher
from replica.sampling import Sampler, SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import SeqStatus, Sequence
from replica.slot_pool import AdapterSlotPool, SlotState

BASE_KEY = "__base__"  # the base model's pool name when its slot is not pinned (ablation)


class RequestError(ValueError):
    """A request the engine cannot serve (unknown adapter, too long, ...)."""


@dataclass
class StepOutput:
    seq: Sequence
    new_token: int | None  # None when the sequence ended without a token (abort, error)
    finished: bool


@dataclass
class EngineStats:
    idle_on_loads_seconds: float = 0.0  # step loop idle: nothing runnable, loads in flight
    prefetch_seconds: float = 0.0  # step loop bookkeeping: polling, planning, submitting
    steps: int = 0  # steps that ran a batch
    # Where an adapter request's adapter was when it arrived: in a device slot (ready or
    # loading), only in host memory, or neither (fetched from the source).
    lookups_device: int = 0
    lookups_host: int = 0
    lookups_miss: int = 0
    aborted: int = 0  # requests ended by abort() (client gone, deadline) before they finished


class LLMEngine:
    def __init__(self, config: EngineConfig, source: AdapterSource | None = None) -> None:
        self.config = c = config
        self.device = resolve_device(c.device)
        self.dtype = resolve_dtype(c.dtype, self.device)
        self.spec = load_model_spec(c.model)

        def runner(rank: TPRank | None = None) -> ModelRunner:
            return ModelRunner(c, self.spec, self.device, self.dtype, rank)

        if c.tp_size == 1:
            self.tp, self.runner = None, runner()
        else:  # this engine is rank 0; ranks 1..N-1 are actors that build their shards meanwhile
            self.tp, self.runner = TPGroup.start(c, self.device, runner)
        self.lora, self.model, self.kv = self.runner.lora, self.runner.model, self.runner.kv
        num_blocks = self.runner.num_blocks
        self.max_model_len = min(
            c.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
            num_blocks * c.block_size,
        )
        self.source = source or PeftDirectorySource(self.spec, c.max_lora_rank, {})
        adapters = _WithBase(self.source)
        staged, slots, self.executor = adapters, self.lora, self.runner
        if self.tp is not None:  # each rank stages its own shard, into the slots rank 0 picks
            staged = ShardedSource(adapters, self.tp.rank.shard)
            slots = ShardedSlotWriter(self.lora, self.tp, adapters.locate)
            self.executor = TPExecutor(self.tp, self.runner)
        self.host_cache = HostCache(staged, c.host_cache_bytes)
        self.pool = AdapterSlotPool(c.num_slots, make_policy(c.eviction_policy), c.max_lora_rank)
        sync = c.adapter_loading == "sync"
        self.loader = InlineLoader(self.device) if sync else SideStreamLoader(self.device)
        window = c.max_loras_per_batch if sync else c.prefetch_window
        self.prefetcher = Prefetcher(
            self.pool, slots, self.host_cache, self.loader, window, c.max_loads_in_flight
        )
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            self.pool,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.max_loras_per_batch,
            c.aging_steps,
        )
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._unloading: set[str] = set()

    # -- adapters ------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        """Register a PEFT directory as `name`: validated and staged in the host cache now,
        copied into a device slot when a request needs it."""
        if not isinstance(self.source, PeftDirectorySource):
            raise TypeError("load_adapter needs the PEFT directory source")
        if name in self._unloading:
            raise RequestError(f"adapter {name!r} is being unloaded: requests on it still run")
        self.source.add(name, path)
        self.host_cache.drop(name)
        try:
            return self.host_cache.get(name)
        except Exception:
            self.source.remove(name)
            raise

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` are refused at once. Requests already queued or running
        finish on it; its weights (source, host copy, slot) go when the last one ends."""
        self._unloading.add(name)
        self._evict_unloaded()

    def known_adapters(self) -> list[str]:
        return [n for n in self.source.names() if n not in self._unloading]

    def residency(self) -> dict:
        """What the router needs to place requests: adapters on device (READY slots) and in
        host memory, queue depth and free slots. Host-side state only."""
        pool = self.pool
        return {
            "device_adapters": [
                s.adapter
                for s in pool.slots
                if s.state is SlotState.READY and s.adapter not in (None, BASE_KEY)
            ],
            "host_adapters": self.host_cache.names(),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "free_slots": pool.num_free,
            "adapter_loads": self.prefetcher.loads_started,
            # leak checks (tests/reliability): all blocks free and no slot referenced when idle
            "kv_blocks_free": self.scheduler.allocator.num_free,
            "kv_blocks_total": self.scheduler.allocator.num_blocks,
            "slot_refs": sum(s.refs for s in pool.slots),
            "aborted": self.stats.aborted,
        }

    def drain_telemetry(self) -> dict:
        """Cumulative counters and current gauges for metrics, plus the latencies of the
        loads finished since the last call (drained: one consumer, the metrics exporter)."""
        pf, stats = self.prefetcher, self.stats
        latencies = list(pf.recent_load_seconds)
        pf.recent_load_seconds.clear()
        return {
            "slots": self.pool.occupancy(),
            "lookups": {
                "device": stats.lookups_device,
                "host": stats.lookups_host,
                "miss": stats.lookups_miss,
            },
            "loads_started": pf.loads_started,
            "loads_done": pf.loads_done,
            "loads_used": self.pool.num_used_loads,
            "load_wait_seconds": self.load_wait_seconds,
            "preemptions": self.scheduler.num_preemptions,
            "steps": stats.steps,
            "load_latencies_s": latencies,
        }

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        sampling = sampling or SamplingParams()
        arrival = next(self._arrivals)
        if not prompt_ids:
            raise RequestError("empty prompt")
        if adapter is not None and adapter not in self.known_adapters():
            raise RequestError(
                f"unknown adapter {adapter!r}; known: {sorted(self.known_adapters())}"
            )
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token id out of range [0, {self.spec.vocab_size})")
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the maximum model length {self.max_model_len}"
            )
        key = adapter if adapter is not None else (None if self.config.pin_base_slot else BASE_KEY)
        seq = Sequence(
            request_id or f"req-{arrival}", list(prompt_ids), sampling, adapter, arrival, key
        )
        self.scheduler.add(seq)
        if adapter is not None:
            self._count_lookup(adapter)
        return seq

    def _count_lookup(self, adapter: str) -> None:
        if self.pool.state(adapter) is not None:
            self.stats.lookups_device += 1
        elif self.host_cache.rank_of(adapter) is not None:
            self.stats.lookups_host += 1
        else:
            self.stats.lookups_miss += 1

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End a sequence now; frees its KV blocks and slot reference."""
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, reason)
            self.sampler.release(seq.request_id)
            self.stats.aborted += reason == "abort"
            self._evict_unloaded()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        outputs = self._fail_broken_loads()
        self.prefetcher.prefetch(s.lora_key for s in self.scheduler.waiting)
        if self.config.adapter_loading == "sync":
            outputs += self._fail_broken_loads()  # inline loads finished inside prefetch()
        loaded = time.perf_counter()
        self.stats.prefetch_seconds += loaded - started
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            if self.prefetcher.num_inflight:
                self.prefetcher.wait_any(0.005)  # nothing runnable until a load lands
                self.stats.idle_on_loads_seconds += time.perf_counter() - loaded
            return outputs
        self.stats.steps += 1
        work = scheduled.ordered()
        plan, sampled = plan_batch(work, self.config.block_size)
        ranks, scalings, progress = self.lora.ranks, self.lora.scalings, None
        ending = self._ending_slots(sampled)
        if ending:
            # this step's view of the slots, taken before the hand-over clears ending ones
            ranks, scalings = {g: list(r) for g, r in ranks.items()}, list(scalings)
            progress = StepProgress(self.device)
            waiting = (s.lora_key for s in self.scheduler.waiting)
            if not self.prefetcher.hand_over(waiting, ending, progress):
                progress = None
        hook = {} if progress is None else {"layer_done": progress.layer_done}
        try:
            logits = self.executor.execute(plan, ranks, scalings, **hook)
        finally:
            if progress is not None:
                progress.finish()
        tokens = self.sampler.sample(
            logits, [s.sampling for s in sampled], [s.request_id for s in sampled]
        )
        new_tokens = tokens.tolist()  # sync point: the one device read per step
        for seq, n in work:
            seq.num_computed += n
        outputs += [self._append(seq, tok) for seq, tok in zip(sampled, new_tokens)]
        self._evict_unloaded()
        return outputs

    def _ending_slots(self, sampled: list[Sequence]) -> list[int]:
        """Slots whose every running sequence ends with this step (its last token by
        max_tokens or the context length), when waiting requests could use them: they are
        handed over during the step, each layer loaded once the forward is past it, so a
        batch that ends at once is followed by its successor's adapters, not by a load."""
        if self.tp is not None or self.config.adapter_loading == "sync":
            return []
        if (
            not self.scheduler.waiting
            or self.prefetcher.num_inflight >= self.config.max_loads_in_flight
        ):
            return []
        ending_refs: dict[int, int] = {}
        for seq in sampled:
            last = len(seq.output_ids) + 1 >= seq.sampling.max_tokens
            if seq.slot and (last or seq.num_tokens + 1 >= self.max_model_len):
                ending_refs[seq.slot] = ending_refs.get(seq.slot, 0) + 1
        slots = self.pool.slots
        return [i for i, n in ending_refs.items() if slots[i].refs == n and not slots[i].pinned]

    @property
    def load_wait_seconds(self) -> float:
        """Step-loop time blocked on adapter loads: inside inline loads, or idle because
        nothing could run until a load landed. Bookkeeping is not counted."""
        return self.prefetcher.blocked_seconds + self.stats.idle_on_loads_seconds

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        p = seq.sampling
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.spec.eos_token_ids):
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)
            self.sampler.release(seq.request_id)
        return StepOutput(seq, token, reason is not None)

    def _fail_broken_loads(self) -> list[StepOutput]:
        """Requests whose adapter failed to load end with an error instead of waiting forever."""
        outputs = []
        for failure in self.prefetcher.poll():
            msg = f"adapter {failure.name!r} failed to load: {failure.error}"
            for seq in [s for s in self.scheduler.waiting if s.lora_key == failure.name]:
                seq.error = msg
                self.abort(seq, "error")
                outputs.append(StepOutput(seq, None, True))
        return outputs

    def _evict_unloaded(self) -> None:
        if not self._unloading:
            return
        sched = self.scheduler
        in_use = {s.lora_key for s in itertools.chain(sched.waiting, sched.running)}
        for name in list(self._unloading):
            if name in in_use or self.prefetcher.is_loading(name):
                continue
            if self.pool.evict(name):  # the slot's rank is zeroed when it is reserved again
                self.source.remove(name)
                self.host_cache.drop(name)
                self._unloading.discard(name)

    # -- offline helpers -----------------------------------------------------------------------

    def score(self, prompt_ids: list[int], adapter: str | None = None) -> torch.Tensor:
        """Logits [len(prompt), vocab] of every prompt position (one standalone prefill)."""
        seq = self.add_request(prompt_ids, SamplingParams(max_tokens=1), adapter, "score")
        self.scheduler.waiting.remove(seq)
        seq.slot = self._wait_for_slot(seq.lora_key)
        allocator = self.scheduler.allocator
        seq.blocks = allocator.allocate(blocks_needed(len(prompt_ids), self.config.block_size))
        try:
            plan, _ = plan_batch([(seq, len(prompt_ids))], self.config.block_size)
            return self.executor.execute(plan, self.lora.ranks, self.lora.scalings, all_rows=True)
        finally:
            allocator.free(seq.blocks)

    def generate(
        self, requests: list[tuple[list[int], SamplingParams, str | None]], max_steps: int = 100_000
    ) -> list[Sequence]:
        """Offline: run the requests as one continuous batch to completion."""
        seqs = [self.add_request(ids, sp, adapter) for ids, sp, adapter in requests]
        for _ in range(max_steps):
            if not self.has_work():
                return seqs
            self.step()
        raise RuntimeError(f"generation did not finish within {max_steps} steps")

    def _wait_for_slot(self, key: str | None, timeout_s: float = 60.0) -> int:
        if key is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            slot = self.pool.ready_slot(key)
            if slot is not None:
                return slot
            if not self.prefetcher.is_loading(key) and not self.prefetcher.start(key):
                raise RequestError(f"no adapter slot can be freed for {key!r}")
            time.sleep(0.001)
            for failure in self.prefetcher.poll():
                if failure.name == key:
                    raise RequestError(str(failure.error))
        raise TimeoutError(f"adapter {key!r} did not load within {timeout_s}s")

    def check_health(self) -> None:
        """Raise if the engine cannot serve any more (a tensor-parallel rank has failed)."""
        if self.tp is not None:
            self.tp.check()

    def shutdown(self) -> None:
        self.loader.shutdown()
        if self.tp is not None:
            self.tp.shutdown()


class _WithBase:
    """The source, plus the base model as a rank-0 adapter (used only when its slot is unpinned)."""

    def __init__(self, source: AdapterSource) -> None:
        self.source = source

    def names(self) -> list[str]:
        return self.source.names()

    def fetch(self, name: str) -> LoRAAdapterWeights:
        if name == BASE_KEY:
            return _BaseLocator().fetch(name)
        return self.source.fetch(name)

    def locate(self, name: str) -> AdapterLocator:
        return _BaseLocator() if name == BASE_KEY else self.source.locate(name)


class _BaseLocator:
    """The base model as an adapter: rank 0, no weights."""

    def fetch(self, name: str, select: SelectLoRA | None = None) -> LoRAAdapterWeights:
        return LoRAAdapterWeights(BASE_KEY, 0, 0.0, (), {})
