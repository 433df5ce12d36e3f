"""Batch preparation: scheduled sequences -> ForwardBatch, without a device read.

Everything is built from host state (token lists, block tables, the slot
table's host ranks) into host tensors, then copied with non_blocking.
"""

from __future__ import annotations

import torch

from kernels import SegmentInfo
from replica.attention import AttentionMetadata
from replica.device import to_device
from replica.model import ForwardBatch
from replica.sequence import Sequence


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
    ids, pos, seg_indptr, seg_slots = [], [], [0], []
    logit_rows, sampled = [], []
    dec_tables, dec_ctx, dec_new_slots = [], [], []
    pre_starts, pre_lens, pre_ctx, pre_seq_slots = [], [], [], []
    for seq, n in work:
        start, ctx = seq.num_computed, seq.num_computed + n
        ids += seq.token_slice(start, ctx)
        pos += range(start, ctx)
        row0 = seg_indptr[-1]
        seg_indptr.append(row0 + n)
        seg_slots.append(seq.slot)
        if n == 1 and not pre_starts:
            dec_tables.append(seq.blocks)
            dec_ctx.append(ctx)
            dec_new_slots.append(seq.blocks[start // block_size] * block_size + start % block_size)
        else:
            pre_starts.append(row0)
            pre_lens.append(n)
            pre_ctx.append(ctx)
            pre_seq_slots.append(_token_slots([seq.blocks], block_size)[0, :ctx])  # one op/seq
        if ctx == seq.num_tokens:
            logit_rows.append(row0 + n - 1)
            sampled.append(seq)

    def dev(values, dtype=torch.int64) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    new_slots = [torch.tensor(dec_new_slots, dtype=torch.int64)]
    new_slots += [s[c - n :] for s, c, n in zip(pre_seq_slots, pre_ctx, pre_lens)]
    attn = AttentionMetadata(
        slot_mapping=to_device(torch.cat(new_slots), device),
        num_decode=len(dec_ctx),
        decode_slots=to_device(_token_slots(dec_tables, block_size), device),
        decode_context_lens=dev(dec_ctx),
        prefill_starts=pre_starts,
        prefill_lens=pre_lens,
        prefill_context_lens=pre_ctx,
        prefill_slots=[  # None: a whole-prompt prefill attends to its fresh K/V, not the cache
            None if c == n else to_device(s, device)
            for s, c, n in zip(pre_seq_slots, pre_ctx, pre_lens)
        ],
    )
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
    batch = ForwardBatch(input_ids=dev(ids), positions=dev(pos), attn=attn, lora=lora)
    return batch, dev(logit_rows), sampled


def _token_slots(tables: list[list[int]], block_size: int) -> torch.Tensor:
    """[N, max_blocks*block_size] host int64: the cache slot of every token position."""
    width = max((len(t) for t in tables), default=0)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks.view(len(tables), width, 1) * block_size + offsets).view(
        len(tables), width * block_size
    )
