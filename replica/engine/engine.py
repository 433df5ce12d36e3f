"""The engine of one replica: schedule -> plan -> forward -> sample -> emit.

Single-threaded: the caller (AsyncLLMEngine's loop thread, or an offline loop) owns it.
Adapter loads run on the loader, overlapped with steps (adapters/residency.py); the
device work goes through one executor (executor/), one rank or several.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.adapters.residency import BASE_KEY, AdapterResidency
from replica.adapters.sources import AdapterSource, PeftDirectorySource
from replica.config import EngineConfig
from replica.device import resolve_device, resolve_dtype
from replica.engine.block_allocator import BlockAllocator, blocks_needed
from replica.engine.planner import plan_batch
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import SeqStatus, Sequence
from replica.engine.telemetry import Telemetry
from replica.errors import RequestError
from replica.executor.batch import BatchPlan
from replica.executor.create import create_executor
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.sampler import Sampler
from replica.model.spec import load_model_spec
from replica.wire import SamplingParams

__all__ = ["LLMEngine", "StepOutput"]


@dataclass
class StepOutput:
    seq: Sequence
    new_token: int | None  # None when the sequence ended without a token (abort, error)
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig, source: AdapterSource | None = None) -> None:
        self.config = c = config
        self.device = resolve_device(c.device)
        self.dtype = resolve_dtype(c.dtype, self.device)
        self.spec = load_model_spec(c.model)
        self.executor = create_executor(c, self.spec, self.device, self.dtype)
        num_blocks, self.max_model_len = self.executor.num_blocks, self.executor.max_model_len
        source = source or PeftDirectorySource(self.spec, c.max_lora_rank, {})
        self.adapters = AdapterResidency(
            c, source, self.executor.lora, self.executor.adapter_staging, self.device
        )
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            self.adapters.pool,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.max_loras_per_batch,
            c.aging_steps,
        )
        self.sampler = Sampler()
        self.telemetry = Telemetry(self.scheduler, self.adapters)
        self._arrivals = itertools.count()

    # -- adapters and telemetry ----------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> LoRAAdapterWeights:
        """Register a PEFT directory as `name` (validated and staged in host memory now)."""
        return self.adapters.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` are refused at once. Requests already queued or running
        finish on it; its weights (source, host copy, slot) go when the last one ends."""
        self.adapters.unregister(name)
        self._release_unloaded()

    def known_adapters(self) -> list[str]:
        return self.adapters.known()

    def residency(self) -> dict:
        return self.telemetry.residency()

    def drain_telemetry(self) -> dict:
        return self.telemetry.drain()

    @property
    def load_wait_seconds(self) -> float:
        return self.telemetry.load_wait_seconds

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
        self._check_request(prompt_ids, sampling, adapter)
        key = adapter if adapter is not None else (None if self.config.pin_base_slot else BASE_KEY)
        seq = Sequence(
            request_id or f"req-{arrival}", list(prompt_ids), sampling, adapter, arrival, key
        )
        self.scheduler.add(seq)
        if adapter is not None:
            self.telemetry.count_lookup(adapter)
        return seq

    def _check_request(
        self, prompt_ids: list[int], sampling: SamplingParams, adapter: str | None
    ) -> None:
        if not prompt_ids:
            raise RequestError("empty prompt")
        if adapter is not None and adapter not in self.known_adapters():
            raise RequestError(
                f"unknown adapter {adapter!r}; known: {sorted(self.known_adapters())}"
            )
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token id out of range [0, {self.spec.vocab_size})")
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the maximum model length {self.max_model_len}"
            )

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End a sequence now; frees its KV blocks and slot reference."""
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, reason)
            self.sampler.release(seq.request_id)
            self.telemetry.stats.aborted += reason == "abort"
            self._release_unloaded()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        stats, started = self.telemetry.stats, time.perf_counter()
        outputs = self._fail_broken_loads()
        self.adapters.prefetch(self._waiting_keys())
        if self.config.adapter_loading == "sync":
            outputs += self._fail_broken_loads()  # inline loads finished inside prefetch()
        loaded = time.perf_counter()
        stats.prefetch_seconds += loaded - started
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            if self.adapters.wait_idle(0.005):  # nothing runnable until a load lands
                stats.idle_on_loads_seconds += time.perf_counter() - loaded
            return outputs
        stats.steps += 1
        work = scheduled.ordered()
        plan, sampled = plan_batch(work, self.config.block_size)
        logits = self._forward(plan, sampled)
        params, ids = [s.sampling for s in sampled], [s.request_id for s in sampled]
        tokens = self.sampler.sample(logits, params, ids)
        new_tokens = tokens.tolist()  # sync point: the one device read per step
        for seq, n in work:
            seq.num_computed += n
        outputs += [self._append(seq, tok) for seq, tok in zip(sampled, new_tokens)]
        self._release_unloaded()
        return outputs

    def _forward(self, plan: BatchPlan, sampled: list[Sequence]) -> torch.Tensor:
        """Run the step. Slots whose every sequence ends with it are handed over meanwhile:
        the next requests' adapters are written layer by layer behind the forward, so a
        batch that ends at once is followed by its successors, not by a load."""
        handover = None
        if self.executor.supports_hand_over and self.scheduler.waiting:
            handover = self.adapters.hand_over(self._ending_refs(sampled), self._waiting_keys())
        if handover is None:
            lora = self.executor.lora
            return self.executor.execute(plan, lora.ranks, lora.scalings)
        try:
            return self.executor.execute(
                plan, handover.ranks, handover.scalings, layer_done=handover.progress.layer_done
            )
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
        for failure in self.adapters.poll():
            msg = f"adapter {failure.name!r} failed to load: {failure.error}"
            for seq in [s for s in self.scheduler.waiting if s.lora_key == failure.name]:
                seq.error = msg
                self.abort(seq, "error")
                outputs.append(StepOutput(seq, None, True))
        return outputs

    def _release_unloaded(self) -> None:
        if self.adapters.unloading:
            sched = self.scheduler
            in_use = {s.lora_key for s in itertools.chain(sched.waiting, sched.running)}
            self.adapters.release_unloaded(in_use)

    # -- offline helpers -----------------------------------------------------------------------

    def score(self, prompt_ids: list[int], adapter: str | None = None) -> torch.Tensor:
        """Logits [len(prompt), vocab] of every prompt position (one standalone prefill)."""
        seq = self.add_request(prompt_ids, SamplingParams(max_tokens=1), adapter, "score")
        self.scheduler.waiting.remove(seq)
        seq.slot = self.adapters.wait_ready(seq.lora_key)
        allocator = self.scheduler.allocator
        seq.blocks = allocator.allocate(blocks_needed(len(prompt_ids), self.config.block_size))
        try:
            plan, _ = plan_batch([(seq, len(prompt_ids))], self.config.block_size)
            lora = self.executor.lora
            return self.executor.execute(plan, lora.ranks, lora.scalings, all_rows=True)
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

    def check_health(self) -> None:
        """Raise if the engine cannot serve any more (a tensor-parallel rank has failed)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.adapters.shutdown()
        self.executor.shutdown()
