"""Batch preparation's device half: a BatchPlan of host ints -> ForwardBatch, without a
device read. Host tensors are built here and copied with non_blocking; every rank of a
tensor-parallel replica runs this on the plan rank 0 broadcasts. The plan itself is made
from the scheduled sequences by the engine (engine/scheduler.py: plan_step). SlotTensors
keeps the adapter slot table where the kernels read it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from kernels import SegmentInfo, StateBatch, make_segment_infos, make_state_batch
from replica.device import StagedBuffer, to_device, to_device_packed
from replica.model.decoder import AttentionMetadata, ForwardBatch
from replica.model.lora import MODULE_GROUPS
from replica.model.lora_slots import SlotTable

# The slot table on the device: (ranks per group, scalings, offsets per group).
SlotTensorViews = tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]


@dataclass
class BatchPlan:
    """One step's batch as host values; rows are tokens, decodes (1 token) first."""

    input_ids: list[int]  # [T]: new tokens, sequence by sequence
    positions: list[int]  # [T]: absolute position of each
    seg_indptr: list[int]  # [G+1]: sequence g is rows [indptr[g], indptr[g+1])
    seg_slots: list[int]  # [G]: adapter slot per sequence
    logit_rows: list[int]  # rows whose logits come back: sampled (chunks reaching their last
    # token), then prompt positions scored for prompt logprobs
    decode_tables: list[list[int]]  # per decode: its KV blocks
    decode_context_lens: list[int]  # per decode: tokens in cache incl. the new one
    decode_new_slots: list[int]  # per decode: cache slot of the new token
    prefill_starts: list[int]  # per prefill (chunk): first row
    prefill_lens: list[int]  # per prefill: new tokens
    prefill_context_lens: list[int]  # per prefill: tokens in cache after this step
    prefill_tables: list[list[int]]  # per prefill: its KV blocks
    # hybrid models: per sequence, its row of the linear-attention state pools, and
    # whether it starts from that row (a later chunk, a decode) or from zeros (its first)
    state_slots: list[int] = field(default_factory=list)
    state_initial: list[bool] = field(default_factory=list)
    # (src, dst) state rows to copy before the forward: forked choices start from their
    # parent's state after its prefill (every rank copies, the plan reaching them all)
    state_copies: list[tuple[int, int]] = field(default_factory=list)


def build_batch(
    plan: BatchPlan,
    block_size: int,
    slots: SlotTable,
    device: torch.device,
    slot_tensors: SlotTensorViews | None = None,
) -> tuple[ForwardBatch, torch.Tensor]:
    """The plan's ForwardBatch and its sampled rows (device): host tensors, one copy.
    `slot_tensors`: the slot table already on the device (SlotTensors.tensors()), else
    the host values are copied too."""
    pre_ctx, pre_lens = plan.prefill_context_lens, plan.prefill_lens
    pre_seq_slots = [  # one op per prefill
        _token_slots([blocks], block_size)[0, :ctx]
        for blocks, ctx in zip(plan.prefill_tables, pre_ctx)
    ]
    new_slots = [torch.tensor(plan.decode_new_slots, dtype=torch.int64)]
    new_slots += [s[c - n :] for s, c, n in zip(pre_seq_slots, pre_ctx, pre_lens)]
    # a prefill whose whole prompt is in this step attends to its fresh K/V, not the cache
    cached = [i for i, (c, n) in enumerate(zip(pre_ctx, pre_lens)) if c != n]
    host = {
        "input_ids": torch.tensor(plan.input_ids, dtype=torch.int64),
        "positions": torch.tensor(plan.positions, dtype=torch.int64),
        "slot_mapping": torch.cat(new_slots),
        "logit_rows": torch.tensor(plan.logit_rows, dtype=torch.int64),
        "block_tables": _block_tables(plan.decode_tables),
        "context_lens": torch.tensor(plan.decode_context_lens, dtype=torch.int32),
        "seg_indptr": torch.tensor(plan.seg_indptr, dtype=torch.int32),
        "seg_slots": torch.tensor(plan.seg_slots, dtype=torch.int32),
        **{f"prefill_slots_{i}": pre_seq_slots[i] for i in cached},
    }
    dev = to_device_packed(host, device)  # one host-to-device copy for the whole step
    attn = AttentionMetadata(
        slot_mapping=dev["slot_mapping"],
        num_decode=len(plan.decode_context_lens),
        block_size=block_size,
        decode_block_tables=dev["block_tables"],
        decode_context_lens=dev["context_lens"],
        prefill_starts=plan.prefill_starts,
        prefill_lens=pre_lens,
        prefill_context_lens=pre_ctx,
        prefill_slots=[dev.get(f"prefill_slots_{i}") for i in range(len(pre_lens))],
    )
    indptr = plan.seg_indptr
    lengths = [b - a for a, b in zip(indptr, indptr[1:])]
    # one SegmentInfo per projection group: the same segments, that group's slot ranks
    lora = make_segment_infos(
        lengths, plan.seg_slots, slots.ranks, slots.scalings, slots.offsets, device,
        lambda t: to_device(t, device), (dev["seg_indptr"], dev["seg_slots"]), slot_tensors,
    )  # fmt: skip
    logit_lora = None
    if "lm_head" in slots.ranks:  # engine.lora_embeddings: the head's segments
        logit_lora = _logit_segments(plan, slots, device, slot_tensors)
    linear = None
    if plan.state_slots:
        linear = _state_batch(plan, lengths, device)
    batch = ForwardBatch(dev["input_ids"], dev["positions"], attn, lora, logit_lora, linear)
    return batch, dev["logit_rows"]


def _state_batch(plan: BatchPlan, lengths: list[int], device: torch.device) -> StateBatch:
    """The sequences' rows of the linear-attention state pools (one per segment)."""
    if len(plan.state_slots) != len(lengths) or len(plan.state_initial) != len(lengths):
        raise ValueError(
            f"{len(plan.state_slots)} state slots and {len(plan.state_initial)} flags for "
            f"{len(lengths)} sequences"
        )
    return make_state_batch(
        lengths, plan.state_slots, plan.state_initial, device, lambda t: to_device(t, device)
    )


def _logit_segments(
    plan: BatchPlan,
    slots: SlotTable,
    device: torch.device,
    slot_tensors: SlotTensorViews | None,
) -> SegmentInfo:
    """lm_head LoRA's SegmentInfo over the logit rows: runs of rows of one sequence (rows
    are ordered by sequence within each kind: sampled rows, then prompt-logprob rows)."""
    lens: list[int] = []
    seg_slots: list[int] = []
    last = -1
    for row in plan.logit_rows:
        g = bisect.bisect_right(plan.seg_indptr, row) - 1
        if g == last:
            lens[-1] += 1
        else:
            lens.append(1)
            seg_slots.append(plan.seg_slots[g])
            last = g
    on_device = None
    if slot_tensors is not None:
        ranks, scalings, offsets = slot_tensors
        on_device = ({"lm_head": ranks["lm_head"]}, scalings, {"lm_head": offsets["lm_head"]})
    infos = make_segment_infos(
        lens, seg_slots, {"lm_head": slots.ranks["lm_head"]}, slots.scalings,
        {"lm_head": slots.offsets["lm_head"]}, device, lambda t: to_device(t, device), None,
        on_device,
    )  # fmt: skip
    return infos["lm_head"]


def _block_tables(tables: list[list[int]]) -> torch.Tensor:
    """[N, max blocks] host int32, short tables padded with block 0 (never read)."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(
        len(tables), width
    )


def _token_slots(tables: list[list[int]], block_size: int) -> torch.Tensor:
    """[N, max_blocks*block_size] host int64: the cache slot of every token position."""
    width = max((len(t) for t in tables), default=0)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks.view(len(tables), width, 1) * block_size + offsets).view(
        len(tables), width * block_size
    )


class SlotTensors:
    """The slot table where the kernels read it: device tensors at fixed addresses,
    rewritten in place (one copy) only when the table a step runs with is another version
    than the last one sent: after a slot is activated or cleared, or for the one step that
    runs with the view taken before a hand-over. Comparing the values instead costs host
    time every step, growing with the slot handles (docs/performance.md)."""

    def __init__(
        self, num_slots: int, device: torch.device, groups: tuple[str, ...] = tuple(MODULE_GROUPS)
    ) -> None:
        self.groups = groups
        layout = {f"ranks.{g}": (torch.int32, (num_slots,)) for g in groups}
        layout |= {f"offsets.{g}": (torch.int32, (num_slots,)) for g in groups}
        layout["scalings"] = (torch.float32, (num_slots,))
        self._buffer = StagedBuffer(layout, device)
        self.ranks = {g: self._buffer.device[f"ranks.{g}"] for g in groups}
        self.offsets = {g: self._buffer.device[f"offsets.{g}"] for g in groups}
        self.scalings = self._buffer.device["scalings"]
        self._sent: int | None = None  # the version of the table last sent
        self.uploads = 0  # how often the values changed (tests: not every step)

    def update(self, table: SlotTable) -> None:
        if table.version == self._sent:
            return
        host = self._buffer.writable()
        for g in self.groups:
            host[f"ranks.{g}"].copy_(torch.tensor(table.ranks[g], dtype=torch.int32))
            host[f"offsets.{g}"].copy_(torch.tensor(table.offsets[g], dtype=torch.int32))
        host["scalings"].copy_(torch.tensor(table.scalings, dtype=torch.float32))
        self._buffer.upload()
        self._sent = table.version
        self.uploads += 1

    def tensors(self) -> SlotTensorViews:
        """(ranks per group, scalings, offsets per group): make_segment_infos' slot_tensors."""
        return self.ranks, self.scalings, self.offsets
