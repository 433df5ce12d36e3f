"""Batch preparation's host half: the scheduled sequences -> a BatchPlan of host ints.

The plan is what a tensor-parallel rank 0 broadcasts each step; the executor turns it
into device tensors (executor/batch.py). plan_batch touches no tensor; prepare_batch runs
both halves at once (tests, offline callers).
"""

from __future__ import annotations

import torch

from replica.engine.sequence import Sequence
from replica.executor.batch import BatchPlan, build_batch
from replica.model.decoder import ForwardBatch
from replica.model.lora_slots import SlotTable


def prepare_batch(
    work: list[tuple[Sequence, int]],
    block_size: int,
    slots: SlotTable,
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor, list[Sequence]]:
    """work: (sequence, new tokens) with decodes (1 token) first.

    Returns the batch, the rows whose logits are sampled (device), and the
    sequences those rows belong to (those whose chunk reaches their last token).
    """
    plan, sampled = plan_batch(work, block_size)
    batch, logit_rows = build_batch(plan, block_size, slots, device)
    return batch, logit_rows, sampled


def plan_batch(
    work: list[tuple[Sequence, int]], block_size: int
) -> tuple[BatchPlan, list[Sequence]]:
    """The plan of `work` ((sequence, new tokens), decodes first) and the sequences
    whose logits it samples, in row order (plan_step without the scored positions)."""
    plan, sampled, _ = plan_step(work, block_size)
    return plan, sampled


def plan_step(
    work: list[tuple[Sequence, int]], block_size: int
) -> tuple[BatchPlan, list[Sequence], list[tuple[Sequence, range]]]:
    """The plan of `work` ((sequence, new tokens), decodes first), the sequences whose
    logits it samples, in row order, and the prompt positions it scores: (sequence,
    positions) of prefills whose request asked for prompt logprobs. The plan's logit rows
    are the sampled rows, then the scored positions' rows in that order."""
    plan = BatchPlan([], [], [0], [], [], [], [], [], [], [], [], [])
    sampled, scored, scored_rows = [], [], []
    for seq, n in work:
        start, ctx = seq.num_computed, seq.num_computed + n
        plan.input_ids += seq.token_slice(start, ctx)
        plan.positions += range(start, ctx)
        row0 = plan.seg_indptr[-1]
        plan.seg_indptr.append(row0 + n)
        plan.seg_slots.append(seq.slot)
        if seq.state_slot is not None:  # a hybrid model: its state row, from zeros at first
            plan.state_slots.append(seq.state_slot)
            plan.state_initial.append(start > 0)
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
        group = seq.group
        positions = group.prompt_logprob_positions(seq, start, ctx) if group else range(0)
        if positions:
            scored.append((seq, positions))
            scored_rows += (row0 + p - start for p in positions)
    plan.logit_rows += scored_rows
    return plan, sampled, scored
