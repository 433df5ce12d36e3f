"""Batch metadata shared by every multi-LoRA kernel."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

# Segments (and, for MoE, batches) of up to this many tokens run the Triton kernels' small
# row tiles, longer ones the large tiles: one of the batch sizes at which a kernel
# compiles another specialisation (kernels.warm_up_batches).
SMALL_TILE_TOKENS = 16


@dataclass(frozen=True)
class SegmentInfo:
    """How the flattened token batch maps onto adapter slots.

    Tokens are grouped in segments (one per sequence, contiguous). Device
    tensors are filled by the engine on the host and copied non_blocking, so
    no kernel launcher may read their values; the host ints below exist for
    exactly that reason.
    """

    seg_indptr: (
        torch.Tensor
    )  # [G+1] int32: token offsets; segment g = rows [indptr[g], indptr[g+1])
    seg_slots: torch.Tensor  # [G] int32: adapter slot per segment; 0 = base model (no LoRA)
    slot_ranks: torch.Tensor  # [S] int32: rank of the adapter in each slot (0 for slot 0)
    slot_scalings: torch.Tensor  # [S] float32: alpha/r (or alpha/sqrt(r) for rsLoRA) per slot
    # [S] int32: the first arena row of each slot's adapter in this group's arenas (its
    # rank rows are [offset, offset + rank) of every layer's A/B arena of the group; 0
    # for slot 0 and free slots)
    slot_offsets: torch.Tensor
    max_seg_len: int  # host: longest segment, sizes the Triton grid without a sync
    has_lora: bool  # host: False when every segment is slot 0 (the whole LoRA path is skipped)
    # host: one token per segment, read only on the device: every backend runs one fixed
    # sequence of ops whatever the values (decode steps replayed as CUDA graphs)
    graph_safe: bool = False

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]


def make_segment_infos(
    seg_lens: Sequence[int],
    seg_slots: Sequence[int],
    group_ranks: Mapping[str, Sequence[int]],
    slot_scalings: Sequence[float],
    group_offsets: Mapping[str, Sequence[int]],
    device: torch.device | str = "cpu",
    copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
    seg_tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_tensors: tuple[Mapping[str, torch.Tensor], torch.Tensor, Mapping[str, torch.Tensor]]
    | None = None,
) -> dict[str, SegmentInfo]:
    """One SegmentInfo per projection group from host lists: the same segments (their
    device tensors shared), each group's own slot ranks and arena offsets. `copy` moves a
    host tensor to `device` (default `.to(device)`; the engine passes a pinned,
    non_blocking copy).
    Values already on the device are used instead of copies of the host lists:
    `seg_tensors` (indptr, slots: the caller copied them with its other metadata) and
    `slot_tensors` (ranks per group, scalings, offsets per group: kept on the device
    between steps).

    has_lora is False when no non-empty segment runs on a slot with a nonzero rank for
    that group: the whole LoRA path is skipped, which changes nothing in the output."""
    if len(seg_lens) != len(seg_slots):
        raise ValueError(f"{len(seg_lens)} segment lengths for {len(seg_slots)} segment slots")
    move = copy or (lambda t: t.to(device))
    indptr = [0]
    for n in seg_lens:
        indptr.append(indptr[-1] + n)
    if seg_tensors is None:
        indptr_dev = move(torch.tensor(indptr, dtype=torch.int32))
        slots_dev = move(torch.tensor(list(seg_slots), dtype=torch.int32))
    else:
        indptr_dev, slots_dev = seg_tensors
    if slot_tensors is None:
        ranks_dev = {
            g: move(torch.tensor(list(r), dtype=torch.int32)) for g, r in group_ranks.items()
        }
        scalings_dev = move(torch.tensor(list(slot_scalings), dtype=torch.float32))
        offsets_dev = {
            g: move(torch.tensor(list(group_offsets[g]), dtype=torch.int32)) for g in group_ranks
        }
    else:
        ranks_dev, scalings_dev, offsets_dev = slot_tensors
    used = {s for s, n in zip(seg_slots, seg_lens) if n > 0 and s != 0}
    infos = {}
    for group, ranks in group_ranks.items():
        if any(not 0 <= s < len(ranks) for s in used):
            raise ValueError(f"seg_slots {sorted(used)} outside the {len(ranks)} slot ranks")
        infos[group] = SegmentInfo(
            seg_indptr=indptr_dev,
            seg_slots=slots_dev,
            slot_ranks=ranks_dev[group],
            slot_scalings=scalings_dev,
            slot_offsets=offsets_dev[group],
            max_seg_len=max(seg_lens, default=0),
            has_lora=any(ranks[s] > 0 for s in used),
        )
    return infos


def make_segment_info(
    seg_lens: Sequence[int],
    seg_slots: Sequence[int],
    slot_ranks: Sequence[int],
    slot_scalings: Sequence[float],
    slot_offsets: Sequence[int],
    device: torch.device | str = "cpu",
    copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SegmentInfo:
    """The SegmentInfo of one projection group (see make_segment_infos)."""
    infos = make_segment_infos(
        seg_lens, seg_slots, {"": slot_ranks}, slot_scalings, {"": slot_offsets}, device, copy
    )
    return infos[""]
