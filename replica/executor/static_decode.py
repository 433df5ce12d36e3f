"""Decode steps at fixed shapes, replayed as CUDA graphs.

A decode-only step (one new token per running sequence) is padded to the smallest
batch-size bucket that holds it, and runs over persistent inputs sized to the largest
bucket: the same tensors, the same shapes, the same op sequence every step of a bucket,
whatever the sequences, their adapters and their context lengths. That is what a CUDA
graph replays; on CUDA each (bucket, with or without LoRA) is captured once at start,
largest first, into one shared memory pool, and a step costs one input copy and one
replay. The static forward also runs eagerly (CPU tests check it op by op; on a GPU it
is the warm-up before each capture).

Padding rows: token 0 at position 0 on slot 0 (the base model), context length 1, and
their K/V written to and read from the scratch block the KV cache keeps past the blocks
the allocator hands out, so they never touch a real sequence's cache.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from kernels import SegmentInfo
from replica.device import StagedBuffer
from replica.executor.batch import BatchPlan
from replica.model.attention import AttentionMetadata
from replica.model.decoder import CausalLM, ForwardBatch
from replica.model.kv_cache import KVCache
from replica.model.lora_slots import SlotTensors

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then multiples of 8, up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeInputs:
    """The persistent inputs of decode steps, sized to the largest bucket: filled on the
    host each step and sent with one copy (replica.device.StagedBuffer)."""

    def __init__(
        self,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        n, w = max_seqs, max_blocks_per_seq
        self.block_size, self.scratch_block = block_size, scratch_block
        self.buffer = StagedBuffer(
            {
                "input_ids": (torch.int64, (n,)),
                "positions": (torch.int64, (n,)),
                "slot_mapping": (torch.int64, (n,)),  # cache slot of each new token
                "context_lens": (torch.int32, (n,)),  # tokens in cache incl. the new one
                "token_slots": (torch.int32, (n,)),  # adapter slot of each token
                "block_tables": (torch.int32, (n, w)),
            },
            device,
        )
        self.tensors = self.buffer.device
        # one token per sequence: the segment offsets never change
        self.seg_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)

    def fill(self, plan: BatchPlan, bucket: int) -> None:
        """The plan's rows, then padding rows up to `bucket`; one copy to the device."""
        host = {k: t.numpy() for k, t in self.buffer.writable().items()}
        b, scratch = len(plan.decode_context_lens), self.scratch_block
        host["input_ids"][:b] = plan.input_ids
        host["positions"][:b] = plan.positions
        host["slot_mapping"][:b] = plan.decode_new_slots
        host["context_lens"][:b] = plan.decode_context_lens
        host["token_slots"][:b] = plan.seg_slots
        tables = host["block_tables"]
        for i, blocks in enumerate(plan.decode_tables):
            tables[i, : len(blocks)] = blocks
            tables[i, len(blocks) :] = scratch  # never read: past the context length
        self._pad(host, b, bucket)
        self.buffer.upload()

    def fill_padding(self, bucket: int) -> None:
        """Every row a padding row (warm-up and capture touch only the scratch block)."""
        host = {k: t.numpy() for k, t in self.buffer.writable().items()}
        self._pad(host, 0, bucket)
        self.buffer.upload()

    def _pad(self, host: dict, start: int, end: int) -> None:
        rows = slice(start, end)
        host["input_ids"][rows] = 0
        host["positions"][rows] = 0
        host["slot_mapping"][rows] = self.scratch_block * self.block_size
        host["context_lens"][rows] = 1
        host["token_slots"][rows] = 0
        host["block_tables"][rows] = self.scratch_block


class StaticDecode:
    """Decode-only steps of one rank at bucket shapes, as CUDA graphs where captured."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        slot_tensors: SlotTensors,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv, self.slot_tensors = model, kv, slot_tensors
        self.buckets = decode_buckets(max_num_seqs)
        self.inputs = DecodeInputs(
            self.buckets[-1], max_blocks_per_seq, block_size, scratch_block, device
        )
        self.max_blocks_per_seq = max_blocks_per_seq
        self._batches = {
            (b, lora): self._batch(b, lora) for b in self.buckets for lora in (False, True)
        }
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, plan: BatchPlan) -> bool:
        """A decode-only plan within the largest bucket and the table width."""
        return (
            not plan.prefill_starts
            and 0 < len(plan.decode_context_lens) <= self.buckets[-1]
            and max(len(t) for t in plan.decode_tables) <= self.max_blocks_per_seq
        )

    def bucket(self, batch_size: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def run(self, plan: BatchPlan, slot_ranks: dict[str, list[int]]) -> torch.Tensor:
        """float32 logits [batch size, vocab] of a plan that fits()."""
        size = len(plan.decode_context_lens)
        bucket = self.bucket(size)
        lora = any(ranks[s] for ranks in slot_ranks.values() for s in plan.seg_slots)
        self.inputs.fill(plan, bucket)
        graph = self._graphs.get((bucket, lora))
        if graph is None:
            return self.forward(bucket, lora)[:size]
        graph[0].replay()
        return graph[1][:size]

    @torch.inference_mode()
    def forward(self, bucket: int, lora: bool) -> torch.Tensor:
        """The static forward over the inputs' first `bucket` rows: [bucket, vocab]."""
        return self.model.forward(self._batches[(bucket, lora)], self.kv)

    def capture(self) -> None:
        """Capture every (bucket, LoRA or not) as a CUDA graph, largest first, into one
        memory pool. A failure (out of memory, an op that cannot be captured) is logged
        and leaves every step eager: the replica keeps serving."""
        started, before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        try:
            for bucket in reversed(self.buckets):
                for lora in (True, False):
                    self.inputs.fill_padding(bucket)
                    self.forward(bucket, lora)  # warm-up: kernels compiled, caches filled
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.forward(bucket, lora)
                    self._graphs[(bucket, lora)] = (graph, out)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
            self._graphs.clear()
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
            return
        log.info(
            "captured %d decode CUDA graphs (buckets %s) in %.1f s, %.0f MiB",
            len(self._graphs), self.buckets, time.perf_counter() - started,
            (torch.cuda.memory_allocated() - before) / 2**20,
        )  # fmt: skip

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _batch(self, bucket: int, lora: bool) -> ForwardBatch:
        """The views of the persistent inputs a bucket's forward reads (made once)."""
        t = self.inputs.tensors
        rows = slice(0, bucket)
        attn = AttentionMetadata(
            slot_mapping=t["slot_mapping"][rows],
            num_decode=bucket,
            block_size=self.inputs.block_size,
            decode_block_tables=t["block_tables"][rows],
            decode_context_lens=t["context_lens"][rows],
            prefill_starts=[],
            prefill_lens=[],
            prefill_context_lens=[],
            prefill_slots=[],
        )
        segments = {
            group: SegmentInfo(
                seg_indptr=self.inputs.seg_indptr[: bucket + 1],
                seg_slots=t["token_slots"][rows],
                slot_ranks=self.slot_tensors.ranks[group],
                slot_scalings=self.slot_tensors.scalings,
                slot_offsets=self.slot_tensors.offsets[group],
                max_seg_len=1,
                has_lora=lora,
                graph_safe=True,
            )
            for group in self.slot_tensors.groups
        }
        return ForwardBatch(t["input_ids"][rows], t["positions"][rows], attn, segments)
