"""The KV cache of one rank, sized at start: by the memory plan on CUDA (a single rank
measures the largest step's activation peak first, as vLLM's profile run does), else
from engine.kv_cache_bytes (256 MiB on a CPU by default)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from replica.config import EngineConfig
from replica.executor.batch import BatchPlan, build_batch
from replica.executor.memory_plan import (
    CPU_KV_CACHE_BYTES,
    MemoryPlan,
    MemoryPlanError,
    largest_step_tokens,
    plan_memory,
    sampler_bytes,
    wanted_max_model_len,
)
from replica.model.decoder import CausalLM
from replica.model.kv_cache import KVCache
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import ModelSpec

log = logging.getLogger(__name__)


class KVSize(NamedTuple):
    num_blocks: int  # blocks the allocator hands out
    max_model_len: int
    plan: MemoryPlan | None  # the plan measured at start (None: sized from the config)


def size_kv_cache(
    config: EngineConfig,
    spec: ModelSpec,
    local: ModelSpec,
    model: CausalLM,
    lora: LoRASlotBuffers,
    device: torch.device,
    dtype: torch.dtype,
) -> KVSize:
    """The KV cache of this rank, once its weights and adapter arenas are on the device.
    On CUDA without engine.kv_cache_bytes: the memory plan, with the activation peak
    profiled on a single rank (a tensor-parallel rank's forward needs every rank, so the
    engine hands those ranks the estimated plan's kv_cache_bytes instead). `local`: the
    shapes of this rank's share (`spec` itself without tensor parallelism)."""
    if device.type == "cuda" and config.kv_cache_bytes is None:
        profile = config.tp_size == 1
        plan = measured_plan(config, spec, model, lora, device, dtype, profile)
        return KVSize(plan.num_blocks, plan.max_model_len, plan)
    per_block = KVCache.bytes_per_block(local, config.block_size, dtype)
    budget = CPU_KV_CACHE_BYTES if config.kv_cache_bytes is None else config.kv_cache_bytes
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise MemoryPlanError(f"kv_cache_bytes={budget} is below one block ({per_block})")
    return KVSize(num_blocks, fit_max_model_len(config, spec, num_blocks), None)


def fit_max_model_len(config: EngineConfig, spec: ModelSpec, num_blocks: int) -> int:
    """max_model_len for a KV cache of `num_blocks` set in bytes: the config's when one such
    sequence fits, else MemoryPlanError; without one, the model's context, capped (with a
    warning) at the cache's tokens."""
    wanted, tokens = wanted_max_model_len(config, spec), num_blocks * config.block_size
    if wanted <= tokens:
        return wanted
    if config.max_model_len is not None:
        raise MemoryPlanError(
            f"max_model_len {wanted:,} does not fit a KV cache of {num_blocks:,} blocks "
            f"({tokens:,} tokens): short by {wanted - tokens:,} tokens (raise "
            "engine.kv_cache_bytes or lower engine.max_model_len)"
        )
    log.warning(
        "max_model_len is %d tokens, what the KV cache holds, below the model's context of "
        "%d: set engine.max_model_len to choose, or a larger engine.kv_cache_bytes",
        tokens, wanted,
    )  # fmt: skip
    return tokens


def measured_plan(
    config: EngineConfig,
    spec: ModelSpec,
    model: CausalLM,
    lora: LoRASlotBuffers,
    device: torch.device,
    dtype: torch.dtype,
    profile: bool = True,
) -> MemoryPlan:
    """The memory plan from what the device reports now: the weights this process holds
    (beside the adapter arenas), what others and the CUDA context hold, and with `profile`
    the largest step's activation peak."""
    activation = None
    if profile:
        activation = profile_activation_bytes(config, spec, model, lora, device, dtype)
    torch.cuda.empty_cache()  # the profile's blocks back to the device: counted as free
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)
    held = torch.cuda.memory_allocated(device)
    return plan_memory(
        spec, config, dtype, total,
        in_use_bytes=total - free - ours,
        weights_bytes=held - lora.nbytes(),
        activation_bytes=activation,
    )  # fmt: skip


def profile_activation_bytes(
    config: EngineConfig,
    spec: ModelSpec,
    model: CausalLM,
    lora: LoRASlotBuffers,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """The largest step's peak working memory: one forward of max_num_batched_tokens
    tokens (at most max_model_len) of a prefill chunk ending at max_model_len, LoRA on
    in every projection group at max_lora_rank, a logit row per token, measured as
    max_memory_allocated beyond what was allocated before it (a KV cache for that one
    sequence included, freed after); plus the sampler's estimate (it runs in the engine)."""
    max_len = wanted_max_model_len(config, spec)
    n, bs = largest_step_tokens(config, max_len), config.block_size
    blocks = -(-max_len // bs)
    plan = BatchPlan(
        input_ids=[0] * n, positions=list(range(max_len - n, max_len)), seg_indptr=[0, n],
        seg_slots=[1], logit_rows=list(range(n)), decode_tables=[], decode_context_lens=[],
        decode_new_slots=[], prefill_starts=[0], prefill_lens=[n],
        prefill_context_lens=[max_len], prefill_tables=[list(range(blocks))],
    )  # fmt: skip
    table = lora.view()
    for ranks in table.ranks.values():
        ranks[1] = lora.max_rank  # rows [0, max_rank) of every arena: zeros, added all the same
    table.scalings[1] = 1.0
    kv = KVCache(spec, blocks, bs, device, dtype, num_state_slots=1)
    if kv.states is not None:  # a hybrid model: a later chunk, from its state row
        plan.state_slots, plan.state_initial = [0], [True]
    batch, rows = build_batch(plan, bs, table, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        logits = model.forward(batch, kv, rows)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        raise MemoryPlanError(
            f"the largest step ({n:,} tokens ending at max_model_len {max_len:,}) ran out of "
            "memory while it was profiled: lower engine.max_num_batched_tokens or "
            "engine.max_model_len"
        ) from None
    peak = torch.cuda.max_memory_allocated(device) - before
    del logits, batch, rows, kv
    return peak + sampler_bytes(spec, config, n)
