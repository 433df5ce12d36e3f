"""Torch path of the mixture-of-experts grouped GEMM: the CPU backend (CUDA when forced).

Eager batches read the expert bounds on the host (free on CPU): decode-sized ones run one
bmm over every expert's rows padded to the most any expert has, larger ones one F.linear
per expert over its contiguous sorted rows; each expert's weights read once. Graph-safe
plans (fixed-shape decode steps: a CUDA graph, or the CPU trace of one) run one fixed
sequence of ops whatever the routing: every row times every expert in one batched
matmul, each row keeping its own expert's result. A decode step's P = T*k rows cover
most experts anyway, so that reads about the bytes the per-expert loop reads, for E
times the (small) arithmetic.

Expert LoRA runs as the multi-LoRA ops over the plan's (adapter, expert) groups
(kernels.expert_segments). Eager decode steps (every group one pair) gather each pair's
own rank rows of its adapter's expert, batched by rank: a few ops per projection, and
exactly the rows the step needs (the segmented runs of kernels.sgmv_torch, built for
one adapter per segment, split this scatter of small groups across expert blocks into a
dozen runs per op). Larger groups (prefill) and graph-safe steps use kernels.sgmv_torch.
"""

from __future__ import annotations

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
        if n:  # F.linear: matmul(x, w.t(), out=) took 6x as long on this CPU
            out[lo : lo + n] = F.linear(x[lo : lo + n].float(), w[e].float()).to(x.dtype)
    return out


# Experts with at most this many rows each run as one bmm over [E, max rows, K], padded
# (decode: 16 tokens x top-2 of 8 give ~4 rows an expert; the bmm took 0.41 ms where eight
# F.linear calls took 1.33 ms); more rows, one F.linear per expert.
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
    if plan.graph_safe or plan.max_group_rows > _GATHER_MAX_ROWS:
        return sgmv_torch.lora_shrink(x, a, expert_segments(plan, seg, rows), max_rank)
    num_slices = a.shape[0]
    out = torch.zeros(x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
    rank_major = a.permute(1, 0, 2)  # [E * rows, num_slices, in]: a view
    for r, pairs, arena_rows, _ in _pairs_by_rank(plan, seg, rows):
        n = pairs.shape[0]
        w = rank_major.index_select(0, arena_rows).view(n, r * num_slices, -1)
        xs = x.index_select(0, pairs).float()[:, None, :]  # [n, 1, in]
        res = torch.bmm(xs, w.float().transpose(1, 2))  # [n, 1, r*ns]; a row on the left:
        # MKL's batched [1, in] x [in, r*ns] ran 3.5x as fast as [r*ns, in] x [in, 1]
        res = res.view(n, r, num_slices).transpose(1, 2)  # [n, ns, r]
        out.view(x.shape[0], num_slices, max_rank)[:, :, :r].index_copy_(0, pairs, res)
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
    if plan.graph_safe or plan.max_group_rows > _GATHER_MAX_ROWS:
        return sgmv_torch.lora_expand(y, inter, b, expert_segments(plan, seg, rows), slice_offsets)
    num_slices = len(slice_offsets) - 1
    r_max = inter.shape[1] // num_slices
    rank_rows = b.t()  # [E * rows, out_total]: rows contiguous in the torch layout
    for r, pairs, arena_rows, scale in _pairs_by_rank(plan, seg, rows):
        n = pairs.shape[0]
        t = inter.index_select(0, pairs).view(n, num_slices, r_max)[:, :, :r] * scale
        w = rank_rows.index_select(0, arena_rows).view(n, r, -1)  # [n, r, out_total]
        # every slice's intermediate times every column, one bmm (slice j keeps cols_j:
        # num_slices x the small arithmetic, one contiguous read of the rows)
        res = torch.bmm(t, w.float())  # [n, ns, out_total]
        acc = y.index_select(0, pairs).float()
        for j in range(num_slices):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            acc[:, c0:c1] += res[:, j, c0:c1]
        y.index_copy_(0, pairs, acc.to(y.dtype))
    return y


# Pairs per (adapter, expert) group up to which a group's rank rows are gathered per pair
# (decode: every group one pair); above, the segmented runs of kernels.sgmv_torch, which
# read each group's rows once for all its pairs.
_GATHER_MAX_ROWS = 1
# The last _pairs_by_rank result and its inputs (held, so their ids stay theirs): one
# layer's four expert LoRA ops share it.
_memo: list = [None, None, 0, None]


def _pairs_by_rank(
    plan: ExpertPlan, seg: SegmentInfo, rows: int
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank r of the pairs' adapters (ranks 0 left out): (r, [n] sorted pair rows,
    [n*r] arena rows of each pair's adapter in its expert's block, [n, 1, 1] scalings).
    Reads which ranks occur on the host (free on CPU: this path runs only there, or when
    forced)."""
    if _memo[0] is plan and _memo[1] is seg and _memo[2] == rows:
        return _memo[3]
    token_seg = torch.searchsorted(seg.seg_indptr[1:].long(), plan.tokens, right=True)
    slot = seg.seg_slots.long().index_select(0, token_seg)  # each pair's slot
    rank = seg.slot_ranks.index_select(0, slot)  # 0 for slot 0 and untargeted groups
    first = seg.slot_offsets.index_select(0, slot).long() + plan.experts * rows
    scale = seg.slot_scalings.index_select(0, slot)
    groups = []
    for r in sorted(set(rank.tolist()) - {0}):
        pairs = (rank == r).nonzero().squeeze(1)
        arena = first.index_select(0, pairs)[:, None] + torch.arange(r, device=first.device)
        groups.append((r, pairs, arena.reshape(-1), scale.index_select(0, pairs)[:, None, None]))
    _memo[:] = [plan, seg, rows, groups]
    return groups
