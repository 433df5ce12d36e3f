"""The executor interface: how the engine runs a step on a replica's devices.

One implementation per way of holding the model: `ModelRunner` (one rank, executor/
runner.py) and `TPExecutor` (rank 0 driving N tensor-parallel ranks, executor/
tp_group.py). `create_executor` (executor/create.py) picks one from the config, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from replica.device import StepProgress
from replica.executor.batch import BatchPlan
from replica.executor.memory_plan import MemoryPlan
from replica.model.decoder import CausalLM
from replica.model.lora_slots import LoRASlotBuffers, SlotTable


class Executor(ABC):
    model: CausalLM  # rank 0's model (its shard under tensor parallelism)
    lora: LoRASlotBuffers  # rank 0's slot buffers: their host slot table holds for every rank
    num_blocks: int  # KV cache blocks the engine allocates (the same on every rank)
    max_model_len: int  # longest prompt + output: the config's, the model's and the cache's
    supports_hand_over: bool  # slot writes can be ordered behind a running step
    memory_plan: MemoryPlan | None = None  # the plan measured at start (a CUDA single rank)

    @abstractmethod
    def execute(
        self,
        plan: BatchPlan,
        slots: SlotTable,
        all_rows: bool = False,
        progress: StepProgress | None = None,
    ) -> torch.Tensor:
        """float32 logits of the plan's sampled rows (of every row if all_rows), gathered
        over the vocabulary, run with the slot table `slots`. `progress` (only if
        supports_hand_over) learns how far the step has got: layer by layer in an eager
        step, all at once after a graph replay."""

    @abstractmethod
    def graph_stats(self) -> dict[str, int]:
        """How decode steps ran: `graphs_captured` (CUDA graphs held, on the rank with
        fewest), `graph_replays` and `eager_decode_steps` (decode-only steps run without
        a graph), since start."""

    @abstractmethod
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV block src[i] into dst[i] on every rank (a request's n choices forking from
        its one prefill), ordered after the steps already run and before the next."""

    @abstractmethod
    def adapter_staging(self, source: Any) -> tuple[Any, Any]:
        """For a source of adapters (anything with fetch/locate): what this replica's host
        cache fetches from, and what the prefetcher writes slots through."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if the executor cannot run steps any more (a rank has failed)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the executor started (rank actors, process groups)."""
