"""Torch path of the mixture-of-experts grouped GEMM: the CPU backend (CUDA when forced).

Eager batches read the expert bounds on the host (free on CPU): decode-sized ones run one
bmm over every expert's rows padded to the most any expert has, larger ones one F.linear
per expert over its contiguous sorted rows; each expert's weights read once. Graph-safe
plans (fixed-shape decode steps: a CUDA graph, or the CPU trace of one) run one fixed
sequence of ops whatever the routing: every row times every expert in one batched
matmul, each row keeping its own expert's result. A decode step's P = T*k rows cover
most experts anyway, so that reads about the bytes the per-expert loop reads, for E
times the (small) arithmetic.

Expert LoRA runs over the plan's (adapter, expert) groups (kernels.expert_segments):
per rank, each group's rank rows of its adapter's expert block gathered once and its
pairs padded to the longest group's, one bmm per rank and projection (decode: a pair per
group). A few ops per projection for the rows the step needs; the segmented runs of
kernels.sgmv_torch, built for one adapter per segment, split this scatter of groups
across expert blocks into a run per group (prefill: 128 runs a projection for 16
adapters of 8 experts). Graph-safe steps use kernels.sgmv_torch's per-token path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import sgmv_torch
from kernels.moe_plan import ExpertPlan, expert_segments
from kernels.segments import SegmentInfo


def moe_grouped_gemm(
    x: torch.Tensor,  # [P, K]: rows sorted by expert
    w: torch.Tensor,  # [E, N, K]
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    if plan.graph_safe:
        every = torch.matmul(x.float()[None], w.float().transpose(1, 2))  # [E, P, N]
        rows = torch.arange(x.shape[0], device=x.device)
        return every[plan.experts, rows].to(x.dtype)
    bounds = plan.expert_indptr.tolist()  # host read: free on CPU
    counts = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    if max(counts, default=0) <= _BMM_MAX_ROWS:  # decode-sized: one padded bmm
        return _padded_bmm(x, w, bounds, counts)
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for e, (lo, n) in enumerate(zip(bounds, counts)):
        if n:  # F.linear: matmul(x, w.t(), out=) is slower on CPU (docs/performance.md)
            out[lo : lo + n] = F.linear(x[lo : lo + n].float(), w[e].float()).to(x.dtype)
    return out


# Experts with at most this many rows each run as one bmm over [E, max rows, K], padded
# (decode: 16 tokens x top-2 of 8 give ~4 rows an expert, where one bmm beats a call per
# expert: docs/performance.md); more rows, one F.linear per expert.
_BMM_MAX_ROWS = 16


def _padded_bmm(
    x: torch.Tensor, w: torch.Tensor, bounds: list[int], counts: list[int]
) -> torch.Tensor:
    """Each expert's rows padded to the most any has (a pad repeats the expert's first
    row, or row 0 for an expert with none: computed, then dropped)."""
    m = max(counts)
    if m == 0:
        return x.new_empty(0, w.shape[1])
    src = [bounds[e] + min(i, n - 1) if n else 0 for e, n in enumerate(counts) for i in range(m)]
    keep = [e * m + i for e, n in enumerate(counts) for i in range(n)]
    device = x.device
    xs = x.index_select(0, torch.tensor(src, device=device)).view(len(counts), m, -1)
    res = torch.bmm(xs.float(), w.float().transpose(1, 2))  # [E, m, N]
    return res.view(-1, w.shape[1]).index_select(0, torch.tensor(keep, device=device)).to(x.dtype)


def expert_lora_shrink(
    x: torch.Tensor,  # [P, in], sorted pairs
    a: torch.Tensor,  # [num_slices, E * rows, in]: an expert A arena
    plan: ExpertPlan,
    seg: SegmentInfo,  # the tokens' segments and slot table
    max_rank: int,
) -> torch.Tensor:  # [P, num_slices * R] float32
    rows = a.shape[1] // plan.num_experts
    if plan.graph_safe:
        return sgmv_torch.lora_shrink(x, a, expert_segments(plan, seg, rows), max_rank)
    p, num_slices = x.shape[0], a.shape[0]
    out = torch.zeros(p, num_slices * max_rank, dtype=torch.float32, device=x.device)
    rank_major = a.permute(1, 0, 2)  # [E * rows, num_slices, in]: a view
    for grp in _groups_by_rank(plan, seg, rows):
        g, m, r = grp.padded.shape[0], grp.padded.shape[1], grp.rank
        xs = x.index_select(0, grp.padded.view(-1)).view(g, m, -1).float()  # [g, m, in]
        w = rank_major.index_select(0, grp.arena_rows).view(g, r * num_slices, -1)
        # rows on the left: MKL's batched [m, in] x [in, r*ns] is faster than
        # [r*ns, in] x [in, m] for decode's m = 1 (docs/performance.md)
        res = torch.bmm(xs, w.float().transpose(1, 2))  # [g, m, r*ns], (c, j) order
        res = _kept(res.view(g * m, r, num_slices).transpose(1, 2), grp.keep)
        out.view(p, num_slices, max_rank)[:, :, :r].index_copy_(0, grp.pairs, res)
    return out


def expert_lora_expand(
    y: torch.Tensor,  # [P, out_total], updated in place
    inter: torch.Tensor,  # [P, num_slices * R] float32
    b: torch.Tensor,  # [out_total, E * rows]: an expert B arena
    plan: ExpertPlan,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:  # y
    rows = b.shape[1] // plan.num_experts
    if plan.graph_safe:
        return sgmv_torch.lora_expand(y, inter, b, expert_segments(plan, seg, rows), slice_offsets)
    num_slices = len(slice_offsets) - 1
    r_max = inter.shape[1] // num_slices
    rank_rows = b.t()  # [E * rows, out_total]: rows contiguous in the torch layout
    for grp in _groups_by_rank(plan, seg, rows):
        g, m, r = grp.padded.shape[0], grp.padded.shape[1], grp.rank
        t = inter.index_select(0, grp.padded.view(-1)).view(g, m, num_slices, r_max)
        t = t[..., :r] * grp.scale  # [g, m, ns, r]
        w = rank_rows.index_select(0, grp.arena_rows).view(g, r, -1).float()  # [g, r, out]
        # every slice's intermediate times every column in one bmm (slice j keeps its
        # columns: num_slices x the small arithmetic, one contiguous read of the rows)
        res = torch.bmm(t.reshape(g, m * num_slices, r), w)  # [g, m*ns, out]
        res = _kept(res.view(g * m, num_slices, -1), grp.keep)  # [n, ns, out]
        acc = y.index_select(0, grp.pairs).float()
        for j in range(num_slices):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            acc[:, c0:c1] += res[:, j, c0:c1]
        y.index_copy_(0, grp.pairs, acc.to(y.dtype))
    return y


@dataclass(frozen=True)
class _Groups:
    """The (adapter, expert) groups of one rank r, their pairs padded to the largest's m
    (a pad repeats the group's first pair: computed, then dropped)."""

    rank: int
    padded: torch.Tensor  # [g, m] int64: sorted pair rows, padded
    keep: torch.Tensor | None  # [n] int64: the real ones' places in padded.view(-1);
    # None when every group has m pairs (decode: one each), nothing padded
    pairs: torch.Tensor  # [n] int64: padded.view(-1)[keep]
    arena_rows: torch.Tensor  # [g * r] int64: each group's adapter rows in its expert block
    scale: torch.Tensor  # [g, 1, 1, 1] float32: each group's adapter scaling


def _kept(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return t if keep is None else t.index_select(0, keep)


# The last _groups_by_rank result and its inputs (held, so their ids stay theirs): one
# layer's four expert LoRA ops share it.
_memo: list = [None, None, 0, None]


def _groups_by_rank(plan: ExpertPlan, seg: SegmentInfo, rows: int) -> list[_Groups]:
    """The plan's non-empty (adapter, expert) groups with a nonzero rank, by rank. Reads
    which ranks occur and the longest group on the host (free on CPU: this path runs only
    there, or when forced)."""
    if _memo[0] is plan and _memo[1] is seg and _memo[2] == rows:
        return _memo[3]
    eseg = expert_segments(plan, seg, rows)  # groups of contiguous sorted pairs
    start = eseg.seg_indptr[:-1].long()
    count = eseg.seg_indptr[1:].long() - start
    vslot = eseg.seg_slots.long()
    rank = torch.where(count > 0, eseg.slot_ranks.index_select(0, vslot), 0)
    first = eseg.slot_offsets.index_select(0, vslot).long()
    scale = eseg.slot_scalings.index_select(0, vslot)
    out = []
    for r in sorted(set(rank.tolist()) - {0}):
        sel = (rank == r).nonzero().squeeze(1)
        n = count.index_select(0, sel)
        m = int(n.max())
        i = torch.arange(m, device=n.device)
        padded = start.index_select(0, sel)[:, None] + torch.minimum(i[None, :], n[:, None] - 1)
        keep = (i[None, :] < n[:, None]).view(-1).nonzero().squeeze(1)
        if keep.shape[0] == padded.numel():
            keep = None
        arena = first.index_select(0, sel)[:, None] + torch.arange(r, device=n.device)
        pairs = _kept(padded.view(-1), keep)
        scales = scale.index_select(0, sel)[:, None, None, None]
        out.append(_Groups(r, padded, keep, pairs, arena.view(-1), scales))
    _memo[:] = [plan, seg, rows, out]
    return out
