"""The engine of one replica: schedule -> prepare -> forward -> sample -> emit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.adapter_format import LoRAAdapterWeights, load_peft_adapter
from replica.batch import prepare_batch
from replica.config import EngineConfig
from replica.device import resolve_device, resolve_dtype
from replica.kv_cache import BlockAllocator, KVCache, blocks_needed
from replica.lora_slots import LoRASlotBuffers
from replica.model import LlamaForCausalLM
from replica.model_config import load_model_spec
from replica.sampling import Sampler, SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import SeqStatus, Sequence


class RequestError(ValueError):
    """A request the engine cannot serve (unknown adapter, too long, ...)."""


@dataclass
class StepOutput:
    seq: Sequence
    new_token: int
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.spec = load_model_spec(config.model)
        self.lora = LoRASlotBuffers(
            self.spec, config.num_slots, config.max_lora_rank, self.device, self.dtype
        )
        self.model = LlamaForCausalLM(config.model, self.device, self.dtype, self.lora, self.spec)
        per_block = KVCache.bytes_per_block(self.spec, config.block_size, self.dtype)
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} is below one block ({per_block})"
            )
        self.kv = KVCache(self.spec, num_blocks, config.block_size, self.device, self.dtype)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.adapter_slots: dict[str, int] = {}
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras_per_batch,
            self.adapter_slots.get,
        )
        self.sampler = Sampler()
        self._arrivals = itertools.count()

    # -- adapters ----------------------------------------------------------------------------

    def load_adapter(self, name: str, source: str | Path | LoRAAdapterWeights) -> int:
        """Put an adapter (a PEFT directory or converted weights) into a free device slot."""
        weights = (
            source
            if isinstance(source, LoRAAdapterWeights)
            else load_peft_adapter(source, self.spec, self.config.max_lora_rank, name)
        )
        slot = self.adapter_slots.get(name)
        if slot is None:
            used = set(self.adapter_slots.values())
            free = [s for s in range(1, self.config.num_slots) if s not in used]
            if not free:
                raise RequestError(
                    f"no free adapter slot for {name!r} (num_slots={self.config.num_slots})"
                )
            slot = free[0]
        self.lora.write(slot, weights)
        self.adapter_slots[name] = slot
        return slot

    # -- requests ----------------------------------------------------------------------------

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
        if adapter is not None and adapter not in self.adapter_slots:
            raise RequestError(f"unknown adapter {adapter!r}; known: {sorted(self.adapter_slots)}")
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token id out of range [0, {self.spec.vocab_size})")
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the maximum model length {self.max_model_len}"
            )
        seq = Sequence(request_id or f"req-{arrival}", list(prompt_ids), sampling, adapter, arrival)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, "abort")
            self.sampler.release(seq.request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return []
        work = scheduled.ordered()
        batch, logit_rows, sampled = prepare_batch(
            work, self.config.block_size, self.lora.ranks, self.lora.scalings, self.device
        )
        logits = self.model.forward(batch, self.kv, logit_rows)
        tokens = self.sampler.sample(
            logits, [s.sampling for s in sampled], [s.request_id for s in sampled]
        )
        new_tokens = tokens.tolist()  # sync point: the one device read per step
        for seq, n in work:
            seq.num_computed += n
        return [self._append(seq, tok) for seq, tok in zip(sampled, new_tokens)]

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

    def score(self, prompt_ids: list[int], adapter: str | None = None) -> torch.Tensor:
        """Logits [len(prompt), vocab] of every prompt position (one standalone prefill)."""
        seq = Sequence("score", list(prompt_ids), SamplingParams(), adapter, -1)
        seq.slot = 0 if adapter is None else self.adapter_slots[adapter]
        allocator = self.scheduler.allocator
        seq.blocks = allocator.allocate(blocks_needed(len(prompt_ids), self.config.block_size))
        try:
            batch, _, _ = prepare_batch(
                [(seq, len(prompt_ids))],
                self.config.block_size,
                self.lora.ranks,
                self.lora.scalings,
                self.device,
            )
            return self.model.forward(batch, self.kv)
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
