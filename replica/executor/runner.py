"""One rank's device state (weights, adapter slot buffers, paged KV cache) and its forward.

The engine's executor when the replica has one rank; under tensor parallelism rank 0's
TPExecutor drives one of these, and every other rank's actor owns one too, built from
the same config, running the plans rank 0 sends it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from replica.config import EngineConfig
from replica.executor.base import Executor
from replica.executor.batch import BatchPlan, build_batch
from replica.model.kv_cache import KVCache
from replica.model.llama import LlamaForCausalLM
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import ModelSpec
from replica.model.tp_layers import TPRank


class ModelRunner(Executor):
    supports_hand_over = True

    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPRank | None = None,
    ) -> None:
        c = config
        self.block_size, self.device = c.block_size, device
        local = spec if tp is None else tp.shard.local_spec  # this rank's heads and KV heads
        shapes = None if tp is None else tp.shard.lora_shapes()
        self.lora = LoRASlotBuffers(spec, c.num_slots, c.max_lora_rank, device, dtype, shapes)
        self.model = LlamaForCausalLM(c.model, device, dtype, self.lora, spec, tp)
        per_block = KVCache.bytes_per_block(local, c.block_size, dtype)
        self.num_blocks = c.kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={c.kv_cache_bytes} is below one block ({per_block})")
        self.kv = KVCache(local, self.num_blocks, c.block_size, device, dtype)

    def execute(
        self,
        plan: BatchPlan,
        slot_ranks: dict[str, list[int]],
        slot_scalings: list[float],
        all_rows: bool = False,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        batch, logit_rows = build_batch(
            plan, self.block_size, slot_ranks, slot_scalings, self.device
        )
        rows = None if all_rows else logit_rows
        return self.model.forward(batch, self.kv, rows, layer_done)

    def adapter_staging(self, source: Any) -> tuple[Any, LoRASlotBuffers]:
        return source, self.lora

    def check_health(self) -> None:
        """Nothing to check: the forward runs in the caller's thread and raises there."""

    def shutdown(self) -> None:
        """Nothing to stop: the tensors go with the object."""
