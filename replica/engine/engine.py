"""The engine of one replica: schedule -> plan -> forward -> sample -> emit.

Single-threaded: the caller (AsyncLLMEngine's loop thread, or an offline loop) owns it.
Adapter loads run on the loader, overlapped with steps (adapters/residency.py); the
device work goes through one executor (executor/), one rank or several.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from replica.adapters.memory import CPU_BUDGET_BYTES, config_slot_bytes, size_adapter_slots
from replica.adapters.residency import BASE_KEY, AdapterResidency
from replica.adapters.sources import AdapterSource, PeftDirectorySource
from replica.config import EngineConfig
from replica.device import resolve_device, resolve_dtype, use_device
from replica.engine.emit import Emitter, StepDraw, StepReplies, step_draws
from replica.engine.fair_share import make_policy
from replica.engine.kv_blocks import BlockAllocator, CacheIdentities, blocks_needed
from replica.engine.scheduler import Scheduler, plan_step
from replica.engine.sequence import SeqStatus, Sequence, SequenceGroup
from replica.engine.state_slots import StateSlots
from replica.engine.structured import StructuredOutputs
from replica.engine.telemetry import Telemetry
from replica.errors import RequestError, Unavailable
from replica.executor.batch import BatchPlan
from replica.executor.create import create_executor
from replica.executor.memory_plan import MemoryPlan, plan_memory
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.lora_slots import arena_rows, block_rows
from replica.model.sampler import Sampler
from replica.model.spec import load_model_spec
from replica.wire import GenerateRequest, SamplingParams, applied_text, cache_scope

__all__ = ["LLMEngine", "StepReplies"]

log = logging.getLogger(__name__)

# A cached prefix's blocks hold its KV, not the linear-attention state at its end: a hit
# would start the recurrent layers from the wrong state
HYBRID_NO_PREFIX_CACHE = (
    "prefix caching is off for %s: a hybrid model's linear-attention layers keep a "
    "per-sequence state that KV blocks do not hold"
)


class LLMEngine:
    def __init__(self, config: EngineConfig, source: AdapterSource | None = None) -> None:
        self.device = resolve_device(config.device)
        use_device(self.device)  # for this thread's build and offline steps (generate, score)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.spec = load_model_spec(config.model)
        # the slot count and per-batch limit (and a TP replica's KV cache), sized from
        # memory unless set
        self.config = c = self._size_memory(config)
        self.executor = create_executor(c, self.spec, self.device, self.dtype)
        num_blocks, self.max_model_len = self.executor.num_blocks, self.executor.max_model_len
        log.info(self._start_line())
        source = source or PeftDirectorySource(
            self.spec, c.max_lora_rank, {}, c.lora_embeddings, c.lora_experts
        )
        self.adapters = AdapterResidency(
            c, source, self.executor.lora, self.executor.adapter_staging, self.device
        )
        hybrid = self.spec.linear_attention is not None
        if hybrid and c.enable_prefix_caching:
            log.info(HYBRID_NO_PREFIX_CACHE, self.spec.arch)
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            self.adapters.pool,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.adapters.max_loras_per_batch,
            c.adapters.aging_steps,
            c.enable_prefix_caching and not hybrid,
            make_policy(c.scheduling),
            StateSlots(c.max_num_seqs) if hybrid else None,
        )
        self.sampler = Sampler(self.spec.eos_token_ids)
        self.structured = StructuredOutputs(c.model, self.spec.vocab_size, self.spec.eos_token_ids)
        self.telemetry = Telemetry(self.scheduler, self.adapters, self.executor.graph_stats)
        self.limits = RequestLimits(
            self.spec.vocab_size, self.max_model_len, self.adapters.tier, self.structured
        )
        self.emitter = Emitter(
            self.scheduler,
            self.spec.eos_token_ids,
            self.max_model_len,
            self.executor.copy_blocks,
            self._finish,
        )
        self.cache_ids = CacheIdentities(self.scheduler.prefix)
        self._arrivals = itertools.count()

    def _size_memory(self, config: EngineConfig) -> EngineConfig:
        """`config` with the adapter slots sized. On CUDA by the memory plan from the
        device's memory (refused here, before any weight is read, when the model cannot
        fit); a tensor-parallel replica also fixes every rank's KV cache from it (a
        single rank sizes its own after profiling, executor/memory_profile.py)."""
        self.plan: MemoryPlan | None = None
        if self.device.type != "cuda":
            return size_adapter_slots(config, self.spec, self.dtype, CPU_BUDGET_BYTES)
        free, total = torch.cuda.mem_get_info(self.device)
        self.plan = plan = plan_memory(
            self.spec, config, self.dtype, total, in_use_bytes=total - free
        )
        config = config.with_adapters(
            num_slots=plan.num_slots,
            max_loras_per_batch=plan.max_loras_per_batch,
            adapter_memory_bytes=None,
        )
        if config.tp_size > 1 and config.kv_cache_bytes is None:
            update = {"kv_cache_bytes": plan.kv_cache_bytes, "max_model_len": plan.max_model_len}
            config = config.model_copy(update=update)
        return config

    def _start_line(self) -> str:
        """The memory of this replica in one line: the plan on CUDA (KV tokens and blocks,
        concurrency at max_model_len, graphs, adapter rows), the KV cache on a CPU; the
        adapters the arenas hold."""
        c, blocks = self.config, self.executor.num_blocks
        plan = self.executor.memory_plan or self.plan
        if plan is not None:
            memory = plan.summary()
        else:
            per_seq = -(-self.max_model_len // c.block_size)
            memory = (
                f"KV cache: {blocks * c.block_size:,} tokens in {blocks:,} blocks of "
                f"{c.block_size}, {blocks / per_seq:.2f} sequences of max_model_len "
                f"{self.max_model_len:,} at once; adapter arenas: "
                f"{arena_rows(c.adapters.num_slots, c.max_lora_rank)} rank rows per "
                "projection group"
            )
        row = config_slot_bytes(c, self.spec, 1, self.dtype)
        rows = arena_rows(c.adapters.num_slots, c.max_lora_rank)
        return (
            f"{memory}; {row:,} bytes a rank row in every group: {c.adapters.num_slots - 1} "
            f"adapters at rank {c.max_lora_rank} ({rows // block_rows(8)} at rank 8), up to "
            f"{c.adapters.max_loras_per_batch} per batch"
        )

    # -- adapters and telemetry ----------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        """Register a PEFT directory as `name` (validated and staged in host memory now)."""
        weights = self.adapters.register(name, path)
        self.cache_ids.retire(name)
        log.info("adapter %r applies %s", name, applied_text(weights.applied()))
        return weights

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` are refused at once. Requests already queued or running
        finish on it; its weights (source, host copy, slot) go when the last one ends."""
        self.adapters.unregister(name)
        self.cache_ids.retire(name)
        self._release_unloaded()

    def set_load_hook(self, hook: Callable[[LoRAAdapterWeights], None] | None) -> None:
        """Run `hook(weights)` after every adapter load's copy into its slot, where the
        load runs (the loader thread; inside the step with sync loading); None removes it.

        A benchmark's seam: its small adapters load faster than real ones, and a hook that
        sleeps makes each load cost what a real one would."""
        self.adapters.prefetcher.load_hook = hook

    def known_adapters(self) -> list[str]:
        return self.adapters.known()

    def residency(self) -> dict:
        return self.telemetry.residency()

    def drain_telemetry(self) -> dict:
        return self.telemetry.drain()

    def graph_stats(self) -> dict[str, int]:
        """How decode steps ran since start: `graphs_captured` (CUDA graphs held),
        `graph_replays`, `eager_decode_steps` (decode-only steps run without a graph)."""
        return self.executor.graph_stats()

    @property
    def load_wait_seconds(self) -> float:
        return self.telemetry.load_wait_seconds

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> Sequence:
        """Queue a request; returns its choice 0 (all n: `.choices`, the request: `.group`).
        RequestError if the engine cannot serve it. Its tenant (weighted by tenant_weight)
        is whose fair share it counts against; its prefix-cache hits come only from the
        same tenant and cache_salt."""
        request = self.limits.bounded(request)
        adapter = None if request.adapter is None else str(request.adapter)
        tier = self.limits.check(request, adapter)
        arrival = next(self._arrivals)
        pinned = self.config.adapters.pin_base_slot
        key = adapter if adapter is not None else (None if pinned else BASE_KEY)
        cache_id = self.cache_ids.of(adapter)
        scope = cache_scope(request.tenant, request.cache_salt)
        seqs = [
            Sequence(request, arrival, key, index=i, cache_id=cache_id, cache_scope=scope)
            for i in range(request.sampling.n)
        ]
        SequenceGroup(seqs)
        if request.sampling.structured_output is not None:
            for seq in seqs:
                seq.matcher = self.structured.matcher(request.sampling.structured_output)
        self.scheduler.add(seqs[0], request.tenant_weight)  # 1..n-1 fork from its prefill
        if tier is not None:
            self.adapters.lookups[tier] += 1
        return seqs[0]

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End a request now, every choice of it (`seq` is any one); frees their KV blocks
        and slot references."""
        ended = [s for s in seq.choices if s.status is not SeqStatus.FINISHED]
        for s in ended:
            self._finish(s, reason)
        if ended:
            self.telemetry.stats.aborted += reason == "abort"
            self._release_unloaded()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepReplies:
        """One step; returns, per request with news, a wire.Reply per choice with news. A
        request that failed is there with its group's `error` set, every choice ended."""
        stats, started = self.telemetry.stats, time.perf_counter()
        outputs: StepReplies = {}
        self._fail_broken_loads(outputs)
        self.adapters.prefetch(self._waiting_keys())
        if self.config.adapters.adapter_loading == "sync":
            self._fail_broken_loads(outputs)  # inline loads finished inside prefetch()
        loaded = time.perf_counter()
        stats.prefetch_seconds += loaded - started
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            if self.adapters.wait_idle(0.005):  # nothing runnable until a load lands
                stats.idle_on_loads_seconds += time.perf_counter() - loaded
            return outputs
        stats.steps += 1
        work = scheduled.ordered()
        plan, sampled, scored = plan_step(work, self.config.block_size)
        plan.state_copies, self.scheduler.state_copies = self.scheduler.state_copies, []
        logits = self._forward(plan, sampled)
        draw = StepDraw(step_draws(sampled), scored)
        packed = draw.sample(self.sampler, logits, len(sampled), self._bitmask(draw))
        values = packed.tolist()  # sync point: the one device read per step (ids, logprobs)
        for seq, n in work:
            stats.prompt_tokens += seq.prompt_part(n)
            seq.num_computed += n
            self.scheduler.prefix.commit(seq)
        self.emitter.emit(draw, *draw.read(values), outputs)
        self.emitter.end_scoring(sampled, outputs)
        for group in outputs:
            if group.error is not None:  # a choice failed: the request ends with it
                self.abort(group.first, "error")
        self._release_unloaded()
        return outputs

    def _forward(self, plan: BatchPlan, sampled: list[Sequence]) -> torch.Tensor:
        """Run the step. Slots whose every sequence ends with it are handed over meanwhile:
        the next requests' adapters are written behind the forward (layer by layer behind
        an eager one, behind the whole of a graph replay), so a batch that ends at once is
        followed by its successors, not by a load."""
        handover = None
        if self.executor.supports_hand_over and self.scheduler.waiting:
            handover = self.adapters.hand_over(self._ending_refs(sampled), self._waiting_keys())
        if handover is None:
            return self.executor.execute(plan, self.executor.lora.table)
        try:
            return self.executor.execute(plan, handover.table, progress=handover.progress)
        finally:
            handover.progress.finish()

    def _ending_refs(self, sampled: list[Sequence]) -> Counter[int]:
        """Per adapter slot, the running sequences that end with this step (their last
        token by max_tokens or by the context length)."""

        def last(seq: Sequence) -> bool:
            by_tokens = len(seq.output_ids) + 1 >= seq.sampling.max_tokens
            return by_tokens or seq.num_tokens + 1 >= self.max_model_len

        return Counter(seq.slot for seq in sampled if seq.slot and last(seq))

    def _waiting_keys(self):
        return (s.lora_key for s in self.scheduler.waiting)

    def _bitmask(self, draw: StepDraw) -> torch.Tensor | None:
        """Structured rows' allowed tokens, filled on the host before the draw."""
        matchers = draw.matchers
        return self.structured.bitmask(matchers) if matchers else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.release(seq.key)

    def _fail_broken_loads(self, out: StepReplies) -> None:
        """Requests whose adapter failed to load end with an error instead of waiting
        forever: in `out`, their groups with the error."""
        for failure in self.adapters.poll():
            error = Unavailable(f"adapter {failure.name!r} failed to load: {failure.error}")
            for seq in [s for s in self.scheduler.waiting if s.lora_key == failure.name]:
                if seq.status is not SeqStatus.FINISHED:  # not ended with another choice
                    seq.group.error = error
                    self.abort(seq, "error")
                    out.setdefault(seq.group, [])

    def _release_unloaded(self) -> None:
        if self.adapters.unloading:
            sched = self.scheduler
            in_use = {s.lora_key for s in itertools.chain(sched.waiting, sched.running)}
            self.adapters.release_unloaded(in_use)

    # -- offline helpers -----------------------------------------------------------------------

    def score(self, prompt_ids: list[int], adapter: str | None = None) -> torch.Tensor:
        """Logits [len(prompt), vocab] of every prompt position (one standalone prefill)."""
        seq = self.add_request(GenerateRequest(prompt_ids, SamplingParams(max_tokens=1), adapter))
        self.scheduler.waiting.remove(seq)
        seq.slot = self.adapters.wait_ready(seq.lora_key)
        allocator, states = self.scheduler.allocator, self.scheduler.states
        seq.blocks = allocator.allocate(blocks_needed(len(prompt_ids), self.config.block_size))
        seq.state_slot = None if states is None else states.acquire()
        try:
            plan, _, _ = plan_step([(seq, len(prompt_ids))], self.config.block_size)
            plan.state_copies, self.scheduler.state_copies = self.scheduler.state_copies, []
            return self.executor.execute(plan, self.executor.lora.table, all_rows=True)
        finally:
            allocator.free(seq.blocks)
            if states is not None:
                states.release(seq.state_slot)

    def generate(
        self, requests: list[tuple[list[int], SamplingParams, str | None]], max_steps: int = 100_000
    ) -> list[Sequence]:
        """Offline: run (prompt_ids, sampling, adapter) requests as one continuous batch to
        completion; their choices 0, in order."""
        seqs = [self.add_request(GenerateRequest(*request)) for request in requests]
        for _ in range(max_steps):
            if not self.has_work():
                return seqs
            self.step()
        raise RuntimeError(f"generation did not finish within {max_steps} steps")

    def check_health(self) -> None:
        """Raise if the engine cannot serve any more (a tensor-parallel rank has failed)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.adapters.shutdown()
        self.executor.shutdown()


class RequestLimits:
    """What a request may ask of this engine, checked once when it is added.

    A request the engine cannot serve is refused with a RequestError (a 400 at the
    ingress) before it is queued: an empty prompt, an unknown adapter, token ids outside
    the vocabulary, more tokens than the context holds, a grammar that does not compile."""

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        tier: Callable[[str], str | None],
        structured: StructuredOutputs,
    ) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.tier, self.structured = tier, structured

    def bounded(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with max_tokens None made the rest of the context (at least 1: a
        prompt that fills it is refused by check)."""
        sampling = request.sampling
        if sampling.max_tokens is not None:
            return request
        rest = max(1, self.max_model_len - len(request.prompt_ids))
        bounded = sampling.model_copy(update={"max_tokens": max(rest, sampling.min_tokens)})
        return dataclasses.replace(request, sampling=bounded)

    def check(self, request: GenerateRequest, adapter: str | None) -> str | None:
        """Raise RequestError if the engine cannot serve this (bounded) request, whose
        adapter the engine names `adapter`; else the tier that adapter is in now (None
        for a base request)."""
        prompt_ids, sampling = request.prompt_ids, request.sampling
        if not prompt_ids:
            raise RequestError("empty prompt")
        tier = None if adapter is None else self.tier(adapter)
        if adapter is not None and tier is None:
            raise RequestError(f"unknown adapter {adapter!r}")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token id out of range [0, {vocab})")
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the maximum model length {self.max_model_len}"
            )
        outside = [t for t, _ in sampling.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias token id {outside[0]} out of range [0, {vocab})")
        if sampling.structured_output is not None:
            self.structured.grammar(sampling.structured_output)  # compiled now: 400 if bad
        return tier
