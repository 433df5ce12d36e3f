"""Batch preparation: scheduled sequences -> ForwardBatch, without a device read.

Two halves: plan_batch reads the sequences into a BatchPlan of host ints (what a
tensor-parallel rank 0 sends the other ranks each step), build_batch turns a plan
into host tensors and copies them with non_blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import SegmentInfo
from replica.attention import AttentionMetadata
from replica.device import to_device
from replica.model import ForwardBatch
from replica.sequence import Sequence


@dataclass
class BatchPlan:
    """One step's batch as host values; rows are tokens, decodes (1 token) first."""

    input_ids: list[int]  # [T]: new tokens, sequence by sequence
    positions: list[int]  # [T]: absolute position of each
    seg_indptr: list[int]  # [G+1]: sequence g is rows [indptr[g], indptr[g+1])
    seg_slots: list[int]  # [G]: adapter slot per sequence
    logit_rows: list[int]  # rows whose logits are sampled (chunks reaching their last token)
    decode_tables: list[list[int]]  # per decode: its KV blocks
    decode_context_lens: list[int]  # per decode: tokens in cache incl. the new one
    decode_new_slots: list[int]  # per decode: cache slot of the new token
    prefill_starts: list[int]  # per prefill (chunk): first row
    prefill_lens: list[int]  # per prefill: new tokens
    prefill_context_lens: list[int]  # per prefill: tokens in cache after this step
    prefill_tables: list[list[int]]  # per prefill: its KV blocks


def prepare_batch(
    work: list[tuple[Sequence, int]],
    block_size: int,
    slot_ranks: dict[str, list[int]],
    slot_scalings: list[float],
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor, list[Sequence]]:
    """work: (sequence, new tokens) with decodes (1 token) first.

    Returns the batch, the rows whose logits are sampled (device), and the
    sequences those rows belong to (those whose chunk reaches their last token).
    """
    plan, sampled = plan_batch(work, block_size)
    batch, logit_rows = build_batch(plan, block_size, slot_ranks, slot_scalings, device)
    return batch, logit_rows, sampled


def plan_batch(
    work: list[tuple[Sequence, int]], block_size: int
) -> tuple[BatchPlan, list[Sequence]]:
    """The plan of `work` ((sequence, new tokens), decodes first) and the sequences
    whose logits it samples, in row order."""
    plan = BatchPlan([], [], [0], [], [], [], [], [], [], [], [], [])
    sampled = []
    for seq, n in work:
        start, ctx = seq.num_computed, seq.num_computed + n
        plan.input_ids += seq.token_slice(start, ctx)
        plan.positions += range(start, ctx)
        row0 = plan.seg_indptr[-1]
        plan.seg_indptr.append(row0 + n)
        plan.seg_slots.append(seq.slot)
        if n == 1 and not plan.prefill_starts:
            plan.decode_tables.append(seq.blocks)
            plan.decode_context_lens.append(ctx)
            plan.decode_new_slots.append(
                seq.blocks[start // block_size] * block_size + start % block_size
            )
        else:
            plan.prefill_starts.append(row0)
            plan.prefill_lens.append(n)
            plan.prefill_context_lens.append(ctx)
            plan.prefill_tables.append(seq.blocks)
        if ctx == seq.num_tokens:
            plan.logit_rows.append(row0 + n - 1)
            sampled.append(seq)
    return plan, sampled


def build_batch(
    plan: BatchPlan,
    block_size: int,
    slot_ranks: dict[str, list[int]],
    slot_scalings: list[float],
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor]:
    """The plan's ForwardBatch and its sampled rows (device), from host tensors."""

    def dev(values, dtype=torch.int64) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    pre_ctx, pre_lens = plan.prefill_context_lens, plan.prefill_lens
    pre_seq_slots = [  # one op per prefill
        _token_slots([blocks], block_size)[0, :ctx]
        for blocks, ctx in zip(plan.prefill_tables, pre_ctx)
    ]
    new_slots = [torch.tensor(plan.decode_new_slots, dtype=torch.int64)]
    new_slots += [s[c - n :] for s, c, n in zip(pre_seq_slots, pre_ctx, pre_lens)]
    attn = AttentionMetadata(
        slot_mapping=to_device(torch.cat(new_slots), device),
        num_decode=len(plan.decode_context_lens),
        decode_slots=to_device(_token_slots(plan.decode_tables, block_size), device),
        decode_context_lens=dev(plan.decode_context_lens),
        prefill_starts=plan.prefill_starts,
        prefill_lens=pre_lens,
        prefill_context_lens=pre_ctx,
        prefill_slots=[  # None: a whole-prompt prefill attends to its fresh K/V, not the cache
            None if c == n else to_device(s, device)
            for s, c, n in zip(pre_seq_slots, pre_ctx, pre_lens)
        ],
    )
    seg_indptr, seg_slots = plan.seg_indptr, plan.seg_slots
    lengths = [b - a for a, b in zip(seg_indptr, seg_indptr[1:])]
    indptr_dev, slots_dev = dev(seg_indptr, torch.int32), dev(seg_slots, torch.int32)
    scalings_dev = dev(slot_scalings, torch.float32)
    lora = {  # one SegmentInfo per projection group: same segments, that group's ranks
        group: SegmentInfo(
            seg_indptr=indptr_dev,
            seg_slots=slots_dev,
            slot_ranks=dev(ranks, torch.int32),
            slot_scalings=scalings_dev,
            max_seg_len=max(lengths, default=0),
            has_lora=any(s != 0 and ranks[s] > 0 for s in seg_slots),
        )
        for group, ranks in slot_ranks.items()
    }
    batch = ForwardBatch(
        input_ids=dev(plan.input_ids), positions=dev(plan.positions), attn=attn, lora=lora
    )
    return batch, dev(plan.logit_rows)


def _token_slots(tables: list[list[int]], block_size: int) -> torch.Tensor:
    """[N, max_blocks*block_size] host int64: the cache slot of every token position."""
    width = max((len(t) for t in tables), default=0)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks.view(len(tables), width, 1) * block_size + offsets).view(
        len(tables), width * block_size
    )
