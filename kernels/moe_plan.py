"""Routing metadata of a mixture-of-experts layer: each token's k (token, expert) pairs
sorted by expert, and within an expert by the token's segment (its sequence, hence its
adapter), so that one grouped GEMM per projection reads each expert's weights once and
expert LoRA runs over (adapter, expert) groups.

Built from the router's top-k ids with device ops of fixed output sizes only (a stable
sort, scatter-adds, cumulative sums): nothing reads a device value, so a decode step
that builds a plan replays as a CUDA graph. One implementation for every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.segments import SegmentInfo


@dataclass(frozen=True)
class ExpertPlan:
    """Pairs p = t*k + j (token t's j-th expert), in sorted order i = 0..P-1."""

    order: torch.Tensor  # [P] int64: the pair at sorted position i
    tokens: torch.Tensor  # [P] int64: its token row (order // k)
    experts: torch.Tensor  # [P] int64: its expert, non-decreasing
    expert_indptr: torch.Tensor  # [E+1] int32: expert e's sorted rows [indptr[e], indptr[e+1])
    # [E*G+1] int32: rows of (expert e, segment g) at [group_indptr[e*G+g], ...[e*G+g+1])
    group_indptr: torch.Tensor
    num_experts: int  # E (host)
    num_segments: int  # G (host): the SegmentInfo's segments, 1 without one
    max_rows: int  # host: most rows one expert can get (the tokens: each picks it once)
    max_group_rows: int  # host: most rows one (expert, segment) group can get
    graph_safe: bool  # host: built for a fixed-shape decode step (one token per segment)

    @property
    def num_pairs(self) -> int:
        return self.order.shape[0]


def make_expert_plan(
    topk_ids: torch.Tensor,  # [T, k] int64: each token's experts, distinct within a row
    num_experts: int,
    seg: SegmentInfo | None = None,  # the tokens' segments (sequences); None: one segment
) -> ExpertPlan:
    """Sort the T*k pairs by (expert, segment); stable, so pairs of one group keep token
    order. No device value is read (the sizes are T, k, E and G)."""
    t, k = topk_ids.shape
    device = topk_ids.device
    if seg is None:
        num_segments, segment = 1, torch.zeros(t, dtype=torch.int64, device=device)
        max_seg, graph_safe = t, False
    else:
        num_segments = seg.num_segments
        ends = seg.seg_indptr[1:].long()  # token row -> its segment: ends[g] > row
        segment = torch.searchsorted(ends, torch.arange(t, device=device), right=True)
        max_seg, graph_safe = seg.max_seg_len, seg.graph_safe
    experts = topk_ids.reshape(-1).long()  # [P], pair order
    key = experts * num_segments + segment.repeat_interleave(k)
    _, order = torch.sort(key, stable=True)
    ones = torch.ones_like(key, dtype=torch.int32)
    counts = torch.zeros(num_experts * num_segments, dtype=torch.int32, device=device)
    counts.scatter_add_(0, key, ones)
    group_indptr = torch.zeros(num_experts * num_segments + 1, dtype=torch.int32, device=device)
    group_indptr[1:] = counts.cumsum(0)
    return ExpertPlan(
        order=order,
        tokens=order // k,
        experts=experts.index_select(0, order),
        expert_indptr=group_indptr[::num_segments].contiguous(),
        group_indptr=group_indptr,
        num_experts=num_experts,
        num_segments=num_segments,
        max_rows=t,
        max_group_rows=min(max_seg, t),
        graph_safe=graph_safe,
    )


def expert_segments(plan: ExpertPlan, seg: SegmentInfo, rows_per_expert: int) -> SegmentInfo:
    """The SegmentInfo of expert LoRA over the plan's sorted pairs: one segment per
    (expert e, segment g) group (graph-safe plans: one per pair), on a virtual slot
    v = s*E + e for the segment's slot s != 0 (0 for the base), whose rank and scaling
    are slot s's and whose arena rows are expert e's block: slot_offsets[s] +
    e * rows_per_expert of an expert arena [num_slices, E * rows_per_expert, in].
    Device ops of fixed sizes only."""
    e, device = plan.num_experts, seg.seg_slots.device
    num_slots = seg.slot_ranks.shape[0]
    expert_ids = torch.arange(e, device=device, dtype=torch.int32)
    ranks = seg.slot_ranks.repeat_interleave(e)  # [S*E]: v = s*E + e
    scalings = seg.slot_scalings.repeat_interleave(e)
    offsets = seg.slot_offsets.repeat_interleave(e) + (expert_ids * rows_per_expert).repeat(
        num_slots
    )
    if plan.graph_safe:  # one pair per segment: its slot from its token's segment
        slots = seg.seg_slots.index_select(0, plan.tokens)  # one token per segment
        vslots = torch.where(slots == 0, 0, slots * e + plan.experts.int())
        indptr = torch.arange(plan.num_pairs + 1, dtype=torch.int32, device=device)
        max_len = 1
    else:
        grid = seg.seg_slots[None, :] * e + expert_ids[:, None]  # [E, G]
        vslots = torch.where(seg.seg_slots[None, :] == 0, 0, grid).reshape(-1)
        indptr, max_len = plan.group_indptr, plan.max_group_rows
    return SegmentInfo(
        seg_indptr=indptr,
        seg_slots=vslots.int(),
        slot_ranks=ranks,
        slot_scalings=scalings,
        slot_offsets=offsets.int(),
        max_seg_len=max_len,
        has_lora=seg.has_lora,
        graph_safe=plan.graph_safe,
    )
