"""Decode steps at fixed shapes, replayed as CUDA graphs.

A decode-only step (one new token per running sequence) is padded to the smallest
batch-size bucket that holds it, and runs over persistent inputs sized to the largest
bucket: the same tensors, the same shapes, the same op sequence every step of a bucket,
whatever the sequences, their adapters and their context lengths. That is what a CUDA
graph replays; on CUDA each (bucket, with or without LoRA) is captured once at start,
largest first, into one shared memory pool, and a step costs one input copy and one
replay. Every graph writes its logits into one shared buffer [max_num_seqs, vocab]
fp32, so the graphs hold that buffer and the pool, nothing per graph. The static
forward also runs eagerly (CPU tests check it op by op; on a GPU it is the warm-up
before capture, and the fallback when capture runs out of memory).

Padding rows: token 0 at position 0 on slot 0 (the base model), context length 1, and
their K/V written to and read from the scratch block the KV cache keeps past the blocks
the allocator hands out, so they never touch a real sequence's cache. A hybrid model's
padding rows likewise write only the state pool's scratch row, and never read it (they
start from zeros).
"""

from __future__ import annotations

import bisect
import logging
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

import kernels
from kernels import SegmentInfo, StateBatch
from replica.device import StagedBuffer, packed_offsets
from replica.executor.batch import BatchPlan, SlotTensors
from replica.model.decoder import AttentionMetadata, CausalLM, ForwardBatch
from replica.model.kv_cache import KVCache

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then multiples of 8, up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def logits_bytes(max_num_seqs: int, vocab: int) -> int:
    """Bytes of the one logits buffer every decode graph writes: [max_num_seqs, vocab] fp32."""
    return max_num_seqs * vocab * 4


def static_decode_bytes(max_num_seqs: int, vocab: int, max_blocks_per_seq: int) -> int:
    """Device bytes a StaticDecode holds beyond the model, the KV cache and the graph pool:
    the shared logits buffer and the persistent inputs (their block tables included)."""
    return logits_bytes(max_num_seqs, vocab) + DecodeInputs.device_bytes(
        max_num_seqs, max_blocks_per_seq
    )


class DecodeInputs:
    """The persistent inputs of decode steps, sized to the largest bucket: filled on the
    host each step and sent with one copy (replica.device.StagedBuffer).

    The block tables the graphs read are [max_seqs, max_blocks_per_seq]; a step fills and
    sends only the columns its sequences use (`table_rows`, [bucket, width] packed at the
    end of the buffer, so the copy stops there; width: the most blocks one of them holds)
    and copies them into the tables on the device. Columns past a sequence's blocks keep
    what earlier steps left there: block ids all, and never read (attention stops at the
    context length)."""

    def __init__(
        self,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        scratch_state: int = 0,
    ) -> None:
        """`scratch_state`: the state pool's scratch row (a hybrid model's)."""
        n, w = max_seqs, max_blocks_per_seq
        self.block_size, self.scratch_block, self.max_blocks = block_size, scratch_block, w
        self.scratch_state = scratch_state
        self.buffer = StagedBuffer(self.layout(n, w), device)
        self.tensors = self.buffer.device
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        # one token per sequence: the segment offsets never change
        self.seg_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)

    @staticmethod
    def layout(n: int, w: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {
            "input_ids": (torch.int64, (n,)),
            "positions": (torch.int64, (n,)),
            "slot_mapping": (torch.int64, (n,)),  # cache slot of each new token
            "context_lens": (torch.int32, (n,)),  # tokens in cache incl. the new one
            "token_slots": (torch.int32, (n,)),  # adapter slot of each token
            "state_slots": (torch.int32, (n,)),  # state-pool row of each (hybrid models)
            "state_initial": (torch.bool, (n,)),  # whether it starts from that row
            "table_rows": (torch.int32, (n * w,)),  # [bucket, width]: last, sent in part
        }

    @classmethod
    def device_bytes(cls, n: int, w: int) -> int:
        """Device bytes of the inputs of up to n sequences of up to w blocks."""
        layout = cls.layout(n, w)
        sizes = {k: s[0] * torch.empty((), dtype=d).element_size() for k, (d, s) in layout.items()}
        _, packed = packed_offsets(sizes)
        return packed + n * w * 4 + (n + 1) * 4  # the buffer, the tables, seg_indptr

    def fill(self, plan: BatchPlan, bucket: int) -> None:
        """The plan's rows, then padding rows up to `bucket`; one copy to the device."""
        host = {k: t.numpy() for k, t in self.buffer.writable().items()}
        b = len(plan.decode_context_lens)
        host["input_ids"][:b] = plan.input_ids
        host["positions"][:b] = plan.positions
        host["slot_mapping"][:b] = plan.decode_new_slots
        host["context_lens"][:b] = plan.decode_context_lens
        host["token_slots"][:b] = plan.seg_slots
        if plan.state_slots:
            host["state_slots"][:b] = plan.state_slots
            host["state_initial"][:b] = plan.state_initial
        width = max(len(t) for t in plan.decode_tables)
        tables = host["table_rows"][: bucket * width].reshape(bucket, width)
        for i, blocks in enumerate(plan.decode_tables):
            tables[i, : len(blocks)] = blocks
        self._pad(host, b, bucket, width)
        self._send(bucket, width)

    def fill_padding(self, bucket: int) -> None:
        """Every row a padding row (warm-up and capture touch only the scratch block)."""
        host = {k: t.numpy() for k, t in self.buffer.writable().items()}
        self._pad(host, 0, bucket, 1)
        self._send(bucket, 1)

    def _pad(self, host: dict, start: int, end: int, width: int) -> None:
        rows = slice(start, end)
        host["input_ids"][rows] = 0
        host["positions"][rows] = 0
        host["slot_mapping"][rows] = self.scratch_block * self.block_size
        host["context_lens"][rows] = 1
        host["token_slots"][rows] = 0
        host["state_slots"][rows] = self.scratch_state
        host["state_initial"][rows] = False
        host["table_rows"][: end * width].reshape(end, width)[rows] = self.scratch_block

    def _send(self, bucket: int, width: int) -> None:
        """One copy of the buffer up to the tables' used part, which then lands in the
        first `width` columns of the tables' first `bucket` rows."""
        self.buffer.upload(self.buffer.offsets["table_rows"] + bucket * width * 4)
        staged = self.tensors["table_rows"][: bucket * width].view(bucket, width)
        self.block_tables[:bucket, :width].copy_(staged, non_blocking=True)


class Graph(Protocol):
    def replay(self) -> None: ...


class CudaGraphs:
    """The CUDA calls capture makes on `device`, in one place (CPU tests hand StaticDecode
    a fake). Capture records on the thread's current device (replica.device.use_device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], None], pool: Any) -> Graph:
        """A graph of the work `step` issues, its memory taken from `pool`."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        return graph

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)


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
        self.model, self.kv, self.slot_tensors, self.device = model, kv, slot_tensors, device
        self.buckets = decode_buckets(max_num_seqs)
        states = kv.states
        scratch_state = 0 if states is None else states.num_slots - 1
        self.inputs = DecodeInputs(
            self.buckets[-1], max_blocks_per_seq, block_size, scratch_block, device,
            scratch_state,
        )  # fmt: skip
        self.max_blocks_per_seq = max_blocks_per_seq
        self._batches = {
            (b, lora): self._batch(b, lora) for b in self.buckets for lora in (False, True)
        }
        # what every step writes, graph or not; a step's result is a view of its rows
        vocab = model.spec.vocab_size
        self.logits = torch.empty(self.buckets[-1], vocab, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, bool], Graph] = {}
        self.replays = 0  # steps run by replaying a graph
        self.eager_steps = 0  # steps run eagerly (no graph for their bucket)

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
        """float32 logits [batch size, vocab] of a plan that fits(): a view of the shared
        logits buffer, valid until the next step."""
        size = len(plan.decode_context_lens)
        bucket = self.bucket(size)
        lora = any(ranks[s] for ranks in slot_ranks.values() for s in plan.seg_slots)
        self.inputs.fill(plan, bucket)
        graph = self._graphs.get((bucket, lora))
        if graph is None:
            self.eager_steps += 1
            self._step(bucket, lora)
        else:
            self.replays += 1
            graph.replay()
        return self.logits[:size]

    @torch.inference_mode()
    def forward(self, bucket: int, lora: bool) -> torch.Tensor:
        """The static forward over the inputs' first `bucket` rows: [bucket, vocab]."""
        return self.model.forward(self._batches[(bucket, lora)], self.kv)

    @torch.inference_mode()
    def _step(self, bucket: int, lora: bool) -> None:
        """The forward, its logits copied into the shared buffer (what a graph holds)."""
        self.logits[:bucket].copy_(self.forward(bucket, lora))

    def warm_up(self) -> None:
        """Run every (bucket, LoRA or not) once eagerly on padding rows: what capture
        records is then compiled and initialised (Triton kernels, cuBLAS, collectives)."""
        for bucket, lora in self._order():
            self.inputs.fill_padding(bucket)
            self._step(bucket, lora)

    def capture(self, graphs: CudaGraphs | None = None) -> None:
        """Capture every (bucket, LoRA or not) as a graph, largest first, into one memory
        pool (after warm_up()). Out of device memory, the graphs captured so far are
        dropped and every step runs eagerly, with a warning naming the bytes; any other
        failure raises (a device fault or a broken context must not become a slow path)."""
        graphs = graphs or CudaGraphs(self.device)
        started, before = time.perf_counter(), graphs.allocated_bytes()
        pool = graphs.pool()
        for bucket, lora in self._order():
            self.inputs.fill_padding(bucket)
            graphs.synchronize()
            try:
                self._graphs[(bucket, lora)] = graphs.capture(
                    lambda b=bucket, lo=lora: self._step(b, lo), pool
                )
            except torch.cuda.OutOfMemoryError as e:
                free = graphs.free_bytes()
                self._graphs.clear()
                log.warning(
                    "CUDA graph capture of decode bucket %d (%s LoRA) ran out of device "
                    "memory (requested %s, %d bytes free): decode steps run eagerly",
                    bucket, "with" if lora else "without", _requested(e), free,
                )  # fmt: skip
                return
            except Exception as e:
                self._graphs.clear()
                raise RuntimeError(
                    f"CUDA graph capture of decode bucket {bucket} ({'with' if lora else 'without'}"
                    f" LoRA) failed: {e} (engine.cuda_graphs: false runs decode steps eagerly)"
                ) from e
        log.info(
            "captured %d decode CUDA graphs (buckets %s) in %.1f s, %.0f MiB",
            len(self._graphs), self.buckets, time.perf_counter() - started,
            (graphs.allocated_bytes() - before) / 2**20,
        )  # fmt: skip

    def drop_graphs(self) -> None:
        """Run every step eagerly from now on (another rank of the group has no graphs)."""
        self._graphs.clear()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _order(self) -> list[tuple[int, bool]]:
        """Largest bucket first: smaller ones then reuse the pool's memory."""
        return [(b, lora) for b in reversed(self.buckets) for lora in (True, False)]

    def _splits(self, bucket: int) -> int:
        """The decode attention's split count for a bucket, fixed for the graph's life:
        chosen for the longest context a table holds (kernels.decode_splits)."""
        context = self.max_blocks_per_seq * self.inputs.block_size
        return kernels.decode_splits(context, bucket, self.kv.pools[0].shape[0])

    def _batch(self, bucket: int, lora: bool) -> ForwardBatch:
        """The views of the persistent inputs a bucket's forward reads (made once)."""
        t = self.inputs.tensors
        rows = slice(0, bucket)
        attn = AttentionMetadata(
            slot_mapping=t["slot_mapping"][rows],
            num_decode=bucket,
            block_size=self.inputs.block_size,
            decode_block_tables=self.inputs.block_tables[rows],
            decode_context_lens=t["context_lens"][rows],
            prefill_starts=[],
            prefill_lens=[],
            prefill_context_lens=[],
            prefill_slots=[],
            decode_splits=self._splits(bucket),
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
        linear = None
        if self.kv.states is not None:  # one token per sequence: cu_seqlens = seg_indptr
            linear = StateBatch(
                cu_seqlens=self.inputs.seg_indptr[: bucket + 1],
                state_slots=t["state_slots"][rows],
                has_initial_state=t["state_initial"][rows],
                seq_lens=(1,) * bucket,
                max_seq_len=1,
            )
        return ForwardBatch(
            t["input_ids"][rows], t["positions"][rows], attn, segments, linear=linear
        )


def _requested(error: torch.cuda.OutOfMemoryError) -> str:
    """The allocation an out-of-memory error names ("Tried to allocate 2.00 GiB")."""
    found = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    return found.group(1) if found else "unknown"
