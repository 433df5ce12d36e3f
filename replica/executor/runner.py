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
from replica.executor.memory_profile import size_kv_cache
from replica.executor.static_decode import StaticDecode
from replica.model.decoder import CausalLM
from replica.model.kv_cache import KVCache
from replica.model.lora_slots import LoRASlotBuffers, SlotTable, SlotTensors
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
        self.lora = LoRASlotBuffers(
            spec, c.num_slots, c.max_lora_rank, device, dtype, shapes, c.lora_embeddings
        )
        self.model = CausalLM(c.model, device, dtype, self.lora, spec, tp, c.load_format)
        kv = size_kv_cache(c, spec, local, self.model, self.lora, device, dtype)
        self.num_blocks, self.max_model_len, self.memory_plan = kv
        # one block past those the allocator hands out: padding rows of static decode
        # steps write and read only there
        self.scratch_block = self.num_blocks
        self.kv = KVCache(local, self.num_blocks + 1, c.block_size, device, dtype)
        self.slot_tensors = SlotTensors(self.lora.num_slots, device, self.lora.groups)
        self.static_decode: StaticDecode | None = None
        if c.cuda_graphs and device.type == "cuda" and tp is None:
            self.static_decode = self.make_static_decode(c.max_num_seqs)
            self.static_decode.capture()

    def make_static_decode(self, max_num_seqs: int) -> StaticDecode:
        """The fixed-shape decode path over this rank's model and cache."""
        blocks = -(-self.max_model_len // self.block_size)
        return StaticDecode(
            self.model, self.kv, self.slot_tensors, max_num_seqs, blocks,
            self.block_size, self.scratch_block, self.device,
        )  # fmt: skip

    def execute(
        self,
        plan: BatchPlan,
        slots: SlotTable,
        all_rows: bool = False,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        self.slot_tensors.update(slots)
        static = self.static_decode
        if static is not None and not all_rows and layer_done is None and static.fits(plan):
            return static.run(plan, slots.ranks)
        batch, logit_rows = build_batch(
            plan, self.block_size, slots, self.device, self.slot_tensors.tensors()
        )
        rows = None if all_rows else logit_rows
        return self.model.forward(batch, self.kv, rows, layer_done)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_blocks(src, dst)

    def adapter_staging(self, source: Any) -> tuple[Any, LoRASlotBuffers]:
        return source, self.lora

    def check_health(self) -> None:
        """Nothing to check: the forward runs in the caller's thread and raises there."""

    def shutdown(self) -> None:
        """Nothing to stop: the tensors go with the object."""
