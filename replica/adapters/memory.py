"""How many device adapter slots a replica holds: sized from a memory budget, not fixed.

A slot holds one adapter's A and B for every layer and projection, padded to
max_lora_rank (LoRASlotBuffers). The budget is engine.adapter_memory_bytes, by default
a share of the device memory the base weights and the KV cache leave (CUDA) or a set
size (CPU). The per-batch adapter limit follows from the slot count: every adapter slot.
"""

from __future__ import annotations

import torch

from replica.config import EngineConfig
from replica.model.lora import MODULE_GROUPS
from replica.model.spec import ModelSpec
from replica.model.tp_shard import TPShard

CPU_BUDGET_BYTES = 1 << 30
CUDA_FREE_SHARE = 0.25  # the rest stays for activations, CUDA graphs and the allocator
# Bound of the default sizing: the slot pool's bookkeeping and a step's slot metadata
# grow with the count; a set adapter_memory_bytes is taken as it is.
MAX_DEFAULT_SLOTS = 256


def slot_bytes(spec: ModelSpec, max_rank: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Device bytes of one slot on one rank: [num_slices*R, in] A and [out, R] B per
    projection group and layer, exactly what LoRASlotBuffers allocates per slot."""
    shapes = spec.module_shapes() if tp_size == 1 else TPShard(spec, 0, tp_size).lora_shapes()
    per_layer = 0
    for names in MODULE_GROUPS.values():
        in_features = shapes[names[0]][0]
        out_total = sum(shapes[n][1] for n in names)
        per_layer += (len(names) * in_features + out_total) * max_rank
    return per_layer * spec.num_layers * dtype.itemsize


def default_budget(
    config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> int:
    """CUDA: CUDA_FREE_SHARE of the memory free now less what the weights (this rank's
    share) and the KV cache will take; CPU: CPU_BUDGET_BYTES."""
    if device.type != "cuda":
        return CPU_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    weights = spec.num_parameters() * dtype.itemsize // config.tp_size
    return max(int((free - weights - config.kv_cache_bytes) * CUDA_FREE_SHARE), 0)


def size_adapter_slots(
    config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> EngineConfig:
    """`config` with num_slots and max_loras_per_batch set (what every rank then builds).
    Raises ValueError when the budget cannot hold slot 0 and one adapter slot."""
    per_slot = slot_bytes(spec, config.max_lora_rank, dtype, config.tp_size)
    num_slots = config.num_slots
    if num_slots is None:
        budget = config.adapter_memory_bytes
        if budget is None:
            budget = default_budget(config, spec, device, dtype)
            num_slots = min(budget // per_slot, MAX_DEFAULT_SLOTS)
        else:
            num_slots = budget // per_slot
        if num_slots < 2:
            raise ValueError(
                f"adapter memory {budget} bytes holds {num_slots} adapter slot(s) of "
                f"{per_slot} bytes (rank {config.max_lora_rank}, {dtype}): at least 2 are "
                "needed (slot 0 is the base model). Raise engine.adapter_memory_bytes or "
                "lower engine.max_lora_rank."
            )
    max_loras = config.max_loras_per_batch
    if max_loras is None:
        max_loras = min(num_slots - 1, config.max_num_seqs)
    update = {"num_slots": num_slots, "max_loras_per_batch": max_loras}
    return config.model_copy(update=update | {"adapter_memory_bytes": None})
