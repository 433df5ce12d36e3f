"""Batch preparation's device half: a BatchPlan of host ints -> ForwardBatch, without a
device read. Host tensors are built here and copied with non_blocking; every rank of a
tensor-parallel replica runs this on the plan rank 0 broadcasts. The plan itself is made
from the scheduled sequences by the engine (engine/planner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import make_segment_infos
from replica.device import to_device
from replica.model.attention import AttentionMetadata
from replica.model.llama import ForwardBatch


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
    indptr = plan.seg_indptr
    lengths = [b - a for a, b in zip(indptr, indptr[1:])]
    # one SegmentInfo per projection group: the same segments, that group's slot ranks
    lora = make_segment_infos(
        lengths, plan.seg_slots, slot_ranks, slot_scalings, device, lambda t: to_device(t, device)
    )
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
