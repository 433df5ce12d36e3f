"""One rank's device state (weights, adapter slot buffers, paged KV cache) and its forward.

The engine's executor when the replica has one rank; under tensor parallelism rank 0's
TPExecutor drives one of these, and every other rank's actor owns one too, built from
the same config, running the plans rank 0 sends it.
"""

from __future__ import annotations

from typing import Any

import torch

import kernels
from replica.config import EngineConfig
from replica.device import StepProgress
from replica.executor.base import Executor
from replica.executor.batch import BatchPlan, SlotTensors, build_batch
from replica.executor.memory_profile import size_kv_cache
from replica.executor.static_decode import StaticDecode
from replica.model.decoder import CausalLM
from replica.model.kv_cache import KVCache
from replica.model.lora_slots import LoRASlotBuffers, SlotTable
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
        shapes = None if tp is None else tp.shard.lora_shapes  # per layer
        self.lora = LoRASlotBuffers(
            spec,
            c.adapters.num_slots,
            c.max_lora_rank,
            device,
            dtype,
            shapes,
            vocab=c.lora_embeddings,
            experts=c.lora_experts,
        )
        self.model = CausalLM(c.model, device, dtype, self.lora, spec, tp, c.load_format)
        kv = size_kv_cache(c, spec, local, self.model, self.lora, device, dtype)
        self.num_blocks, self.max_model_len, self.memory_plan = kv
        # one block past those the allocator hands out: padding rows of static decode
        # steps write and read only there
        self.scratch_block = self.num_blocks
        # a hybrid model's state pool: a row per running sequence, then a scratch row
        self.kv = KVCache(local, self.num_blocks + 1, c.block_size, device, dtype,
                          num_state_slots=c.max_num_seqs + 1)  # fmt: skip
        self.slot_tensors = SlotTensors(self.lora.num_slots, device, self.lora.groups)
        self.max_num_batched_tokens, self.max_num_seqs = c.max_num_batched_tokens, c.max_num_seqs
        self.eager_decode_steps = 0  # decode-only steps the static path did not take
        self.static_decode: StaticDecode | None = None
        if c.cuda_graphs and device.type == "cuda":
            self.static_decode = self.make_static_decode(c.max_num_seqs)
        if device.type == "cuda" and tp is None:  # a TP group starts its ranks together
            self.warm_up()
            self.capture()

    def make_static_decode(self, max_num_seqs: int) -> StaticDecode:
        """The fixed-shape decode path over this rank's model and cache."""
        blocks = -(-self.max_model_len // self.block_size)
        return StaticDecode(
            self.model, self.kv, self.slot_tensors, max_num_seqs, blocks,
            self.block_size, self.scratch_block, self.device,
        )  # fmt: skip

    def warm_up(self) -> None:
        """Run once every shape this rank's steps can launch Triton kernels at (the steps
        of kernels.warm_up_batches, the static decode's buckets), on the scratch block:
        every kernel compiles now, not under the first request of a new shape. Under
        tensor parallelism every rank runs it at once (its collectives pair up)."""
        spec = self.model.spec
        windows = sorted({w for i in range(spec.num_layers) if (w := spec.window(i))})
        kernels.warm_up(
            self._warm_batch, self.max_num_batched_tokens, self.max_num_seqs,
            self.max_model_len, self.block_size, windows,
        )  # fmt: skip
        if self.static_decode is not None:
            self.static_decode.warm_up()

    def capture(self) -> None:
        """Capture the decode graphs (after warm_up()); capture itself communicates
        nothing, so each rank of a group captures on its own (TPGroup.warm_up then has
        all ranks drop theirs if one could not)."""
        if self.static_decode is not None:
            self.static_decode.capture()

    def drop_graphs(self) -> None:
        if self.static_decode is not None:
            self.static_decode.drop_graphs()

    def execute(
        self,
        plan: BatchPlan,
        slots: SlotTable,
        all_rows: bool = False,
        progress: StepProgress | None = None,
    ) -> torch.Tensor:
        self.slot_tensors.update(slots)
        if plan.state_copies:  # forked choices: their parent's state, before any write
            src, dst = zip(*plan.state_copies)
            self.kv.states.copy_slots(list(src), list(dst))
        static = self.static_decode
        # the path depends on (plan, all_rows) alone: every rank of a group takes the same
        if static is not None and not all_rows and static.fits(plan):
            logits = static.run(plan, slots.ranks)
            if progress is not None:
                progress.step_done()  # slot writes go behind the whole step
            return logits
        self.eager_decode_steps += not plan.prefill_starts
        batch, logit_rows = build_batch(
            plan, self.block_size, slots, self.device, self.slot_tensors.tensors()
        )
        rows = None if all_rows else logit_rows
        layer_done = None if progress is None else progress.layer_done
        return self.model.forward(batch, self.kv, rows, layer_done)

    def graph_stats(self) -> dict[str, int]:
        static = self.static_decode
        if static is None:
            return {"graphs_captured": 0, "graph_replays": 0,
                    "eager_decode_steps": self.eager_decode_steps}  # fmt: skip
        return {
            "graphs_captured": static.num_graphs,
            "graph_replays": static.replays,
            "eager_decode_steps": self.eager_decode_steps + static.eager_steps,
        }

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_blocks(src, dst)

    def adapter_staging(self, source: Any) -> tuple[Any, LoRASlotBuffers]:
        return source, self.lora

    def check_health(self) -> None:
        """Nothing to check: the forward runs in the caller's thread and raises there."""

    def shutdown(self) -> None:
        """Nothing to stop: the tensors go with the object."""

    def _warm_batch(self, warm: kernels.WarmBatch) -> None:
        """One eager step of the shapes `warm` gives, on the scratch block, with a
        full-rank adapter on every projection group (kernels.warm_up)."""
        bs, scratch, d = self.block_size, self.scratch_block, warm.decodes
        lens = [n for n, _ in warm.prefills]
        contexts = [ctx for _, ctx in warm.prefills]
        indptr = [0]
        for n in [1] * d + lens:
            indptr.append(indptr[-1] + n)
        plan = BatchPlan(
            input_ids=[0] * indptr[-1],
            positions=[0] * d + [p for n, c in warm.prefills for p in range(c - n, c)],
            seg_indptr=indptr,
            seg_slots=[1] * (len(indptr) - 1),
            logit_rows=[end - 1 for end in indptr[1:]],
            decode_tables=[[scratch] * warm.table_width] * d,
            decode_context_lens=[1] * d,
            decode_new_slots=[scratch * bs] * d,
            prefill_starts=indptr[d:-1],
            prefill_lens=lens,
            prefill_context_lens=contexts,
            prefill_tables=[[scratch] * -(-c // bs) for c in contexts],
        )
        if self.kv.states is not None:  # a hybrid model: distinct rows, from zeros
            rows = self.kv.states.num_slots
            plan.state_slots = [i % rows for i in range(len(indptr) - 1)]
            plan.state_initial = [False] * (len(indptr) - 1)
        batch, rows = build_batch(plan, bs, self._warm_slots(), self.device)
        batch.attn.decode_splits = warm.decode_splits
        self.model.forward(batch, self.kv, rows)

    def _warm_slots(self) -> SlotTable:
        """A slot table with slot 1 at the full rank in every group (at arena row 0,
        scaling 0): every LoRA kernel launches, nothing changes any output."""
        n, rank = self.lora.num_slots, self.lora.max_rank
        groups = self.lora.table.ranks
        return SlotTable(
            ranks={g: [0, rank] + [0] * (n - 2) for g in groups},
            scalings=[0.0] * n,
            offsets={g: [0] * n for g in groups},
            version=-1,
        )
