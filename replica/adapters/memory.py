"""How much device memory a replica gives adapter weights: sized from a budget, not fixed.

Adapters live in arenas of rank rows (LoRASlotBuffers), one per projection group, each
adapter at its own rank in each group: every group's arenas have the same rows,
slot_bytes(spec, 1, ...) is what one rank row costs in all of them, and an adapter of
rank r in a group holds block_rows(r) of that group's rows, the next power of two (none
in a group it does not target). The budget is engine.adapters.adapter_memory_bytes, by default a
share of what the memory plan's budget leaves after weights, activations and CUDA graphs
(CUDA, executor/memory_plan.py) or a set size (CPU); it is kept as num_slots, the arenas
holding num_slots - 1 adapters of max_lora_rank in every group (and 8x as many of rank 8
when max_lora_rank is 64). The per-batch adapter limit follows: num_slots - 1 (so
whatever the batch holds, one max-rank block stays free of it), at most max_num_seqs.
"""

from __future__ import annotations

import torch

from replica.config import EngineConfig
from replica.model.lora import EXPERT_GROUPS, VOCAB_GROUPS, layer_groups
from replica.model.lora_slots import block_rows
from replica.model.spec import ModelSpec
from replica.model.tp_shard import widest_shard

CPU_BUDGET_BYTES = 1 << 30
# Bound of the default sizing: the slot pool's bookkeeping and a step's slot metadata
# grow with the count; a set adapter_memory_bytes is taken as it is.
MAX_DEFAULT_SLOTS = 256


def slot_bytes(
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    tp_size: int = 1,
    vocab: bool = False,
    experts: bool = False,
) -> int:
    """Device bytes of `max_rank` arena rows on one (the widest) rank: [num_slices, R, in] of A and
    [out, R] of B per projection group and layer (and, with `vocab`, of embed_tokens and
    lm_head once), what LoRASlotBuffers allocates per max_rank rows (with max_rank 1: the
    bytes of one rank row). With `experts` (engine.lora_experts), a sparse layer's expert
    groups hold those rows once per expert: an expert adapter's real size, E x (gate, up,
    down) x r rows per layer."""
    if tp_size == 1:
        shapes = spec.lora_shapes()
    else:
        shapes = widest_shard(spec, tp_size).lora_shapes()
    rows = 0
    for layer in range(spec.num_layers):
        own = spec.layer(layer)  # the layer's own shapes, where layers differ (Gemma 4)
        if own is not spec:
            shapes = own.lora_shapes() if tp_size == 1 else widest_shard(own, tp_size).lora_shapes()
        for group, names in layer_groups(spec, layer, experts=experts).items():
            in_features = shapes[names[0]][0]
            out_total = sum(shapes[n][1] for n in names)
            copies = spec.num_experts if group in EXPERT_GROUPS else 1
            rows += copies * (len(names) * in_features + out_total) * max_rank
    once = sum(sum(shapes[g]) * max_rank for g in VOCAB_GROUPS) if vocab else 0
    return (rows + once) * dtype.itemsize


def config_slot_bytes(
    config: EngineConfig, spec: ModelSpec, max_rank: int, dtype: torch.dtype
) -> int:
    """slot_bytes of the arenas `config` builds (its tp_size, lora_embeddings and
    lora_experts): what every sizing of them reads."""
    return slot_bytes(
        spec, max_rank, dtype, config.tp_size, config.lora_embeddings, config.lora_experts
    )


def size_adapter_slots(
    config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, default_budget: int
) -> EngineConfig:
    """`config` with num_slots and max_loras_per_batch set (what every rank then builds):
    from num_slots, else adapter_memory_bytes, else `default_budget` (CPU_BUDGET_BYTES on
    a CPU; on CUDA the memory plan's share, executor/memory_plan.py), at most
    MAX_DEFAULT_SLOTS then. Raises ValueError when the budget cannot hold one adapter of
    max_lora_rank."""
    per_block = config_slot_bytes(config, spec, block_rows(config.max_lora_rank), dtype)
    num_slots = config.adapters.num_slots
    if num_slots is None:
        budget = config.adapters.adapter_memory_bytes
        if budget is None:
            budget = default_budget
            num_slots = 1 + min(budget // per_block, MAX_DEFAULT_SLOTS - 1)
        else:
            num_slots = 1 + budget // per_block
        if num_slots < 2:
            raise ValueError(
                f"adapter memory {budget} bytes is less than one adapter of max_lora_rank "
                f"{config.max_lora_rank} ({per_block} bytes in {dtype}). Raise "
                "engine.adapters.adapter_memory_bytes or lower engine.max_lora_rank."
            )
    max_loras = config.adapters.max_loras_per_batch
    if max_loras is None:
        max_loras = min(num_slots - 1, config.max_num_seqs)
    return config.with_adapters(
        num_slots=num_slots, max_loras_per_batch=max_loras, adapter_memory_bytes=None
    )
