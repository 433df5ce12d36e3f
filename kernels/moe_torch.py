"""Torch path of the mixture-of-experts grouped GEMM: the CPU backend (CUDA when forced).

Eager batches read the expert bounds on the host (free on CPU) and run one matmul per
expert over its contiguous sorted rows: each expert's weights read once. Graph-safe
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
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    bounds = plan.expert_indptr.tolist()  # host read: free on CPU
    for e in range(plan.num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            if x.dtype == torch.float32:
                torch.matmul(x[lo:hi], w[e].t(), out=out[lo:hi])
            else:  # fp32 accumulation, rounded once
                out[lo:hi] = (x[lo:hi].float() @ w[e].float().t()).to(x.dtype)
    return out


def expert_lora_shrink(
    x: torch.Tensor,  # [P, in], sorted pairs
    a: torch.Tensor,  # [num_slices, E * rows, in]: an expert A arena
    plan: ExpertPlan,
    seg: SegmentInfo,  # the tokens' segments and slot table
    max_rank: int,
) -> torch.Tensor:  # [P, num_slices * R] float32
    eseg = expert_segments(plan, seg, a.shape[1] // plan.num_experts)
    if eseg.graph_safe or plan.max_group_rows > _GATHER_MAX_ROWS:
        return sgmv_torch.lora_shrink(x, a, eseg, max_rank)
    num_slices = a.shape[0]
    out = torch.zeros(x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
    rank_major = a.permute(1, 0, 2)  # [E * rows, num_slices, in]: a view
    for r, rows, arena_rows, _ in _by_rank(eseg):
        w = rank_major.index_select(0, arena_rows).view(len(rows), r * num_slices, -1)
        res = torch.bmm(w.float(), x.index_select(0, rows).float()[:, :, None])  # [n, r*ns, 1]
        res = res.view(len(rows), r, num_slices).transpose(1, 2)  # [n, ns, r]
        out.view(x.shape[0], num_slices, max_rank)[:, :, :r].index_copy_(0, rows, res)
    return out


def expert_lora_expand(
    y: torch.Tensor,  # [P, out_total], updated in place
    inter: torch.Tensor,  # [P, num_slices * R] float32
    b: torch.Tensor,  # [out_total, E * rows]: an expert B arena
    plan: ExpertPlan,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:  # y
    eseg = expert_segments(plan, seg, b.shape[1] // plan.num_experts)
    if eseg.graph_safe or plan.max_group_rows > _GATHER_MAX_ROWS:
        return sgmv_torch.lora_expand(y, inter, b, eseg, slice_offsets)
    num_slices = len(slice_offsets) - 1
    r_max = inter.shape[1] // num_slices
    rank_rows = b.t()  # [E * rows, out_total]: rows contiguous in the torch layout
    for r, rows, arena_rows, scale in _by_rank(eseg):
        w = rank_rows.index_select(0, arena_rows).view(len(rows), r, -1).float()  # [n, r, out]
        t = inter.index_select(0, rows).view(len(rows), num_slices, r_max)[:, :, :r] * scale
        acc = torch.zeros(len(rows), y.shape[1], dtype=torch.float32, device=y.device)
        for j in range(num_slices):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            acc[:, c0:c1] = torch.bmm(t[:, j, None, :], w[:, :, c0:c1]).squeeze(1)
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + acc).to(y.dtype))
    return y


# Pairs per (adapter, expert) group up to which a group's rank rows are gathered per pair
# (decode: every group one pair); above, the segmented runs of kernels.sgmv_torch, which
# read each group's rows once for all its pairs.
_GATHER_MAX_ROWS = 1


def _by_rank(eseg: SegmentInfo) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank r of the groups' adapters: (r, [n] pair rows, [n*r] arena rows of each
    pair's adapter and expert, [n, 1, 1] scalings). Reads the metadata on the host (free on
    CPU: this path runs only there, or when forced)."""
    indptr, slots = eseg.seg_indptr.tolist(), eseg.seg_slots.tolist()
    ranks, offsets = eseg.slot_ranks.tolist(), eseg.slot_offsets.tolist()
    scalings = eseg.slot_scalings.tolist()
    groups: dict[int, tuple[list[int], list[int], list[float]]] = {}
    for g, s in enumerate(slots):
        r = ranks[s] if s else 0
        if r == 0:
            continue
        rows, arena, scale = groups.setdefault(r, ([], [], []))
        for i in range(indptr[g], indptr[g + 1]):
            rows.append(i)
            arena.extend(range(offsets[s], offsets[s] + r))
            scale.append(scalings[s])
    device = eseg.seg_slots.device
    return [
        (r, torch.tensor(rows, device=device), torch.tensor(arena, device=device),
         torch.tensor(scale, device=device)[:, None, None])
        for r, (rows, arena, scale) in sorted(groups.items())
    ]  # fmt: skip
