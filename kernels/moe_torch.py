"""Torch path of the mixture-of-experts grouped GEMM: the CPU backend (CUDA when forced).

Eager batches read the expert bounds on the host (free on CPU) and run one matmul per
expert over its contiguous sorted rows: each expert's weights read once. Graph-safe
plans (fixed-shape decode steps: a CUDA graph, or the CPU trace of one) run one fixed
sequence of ops whatever the routing: every row times every expert in one batched
matmul, each row keeping its own expert's result. A decode step's P = T*k rows cover
most experts anyway, so that reads about the bytes the per-expert loop reads, for E
times the (small) arithmetic.
"""

from __future__ import annotations

import torch

from kernels.moe_plan import ExpertPlan


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
