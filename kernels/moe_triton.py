"""Triton grouped GEMM of a mixture-of-experts layer: CUDA, or CPU under TRITON_INTERPRET=1.

Imported lazily by `kernels.moe_grouped_gemm` when the triton backend is chosen. One
program per (expert, row block, column block): the grid is sized from host ints only
(E, ExpertPlan.max_rows, N), so no launcher reads a device value and a decode step
replays as a CUDA graph. A program whose row block lies past its expert's rows returns
after two scalar loads. Each expert's weight tile is read once per row block, so an
expert's rows share its weights (vLLM's fused_moe groups tokens the same way; here the
rows arrive already sorted by expert, see kernels.moe_plan). Tiles are widened to fp32
before tl.dot, accumulation is fp32, one rounding into x's dtype on store.

Expert LoRA is the SGMV kernels (kernels.sgmv_triton) over the plan's (adapter, expert)
groups (kernels.expert_segments): one program per group, reading its adapter's rank rows
of that expert's block once for all its pairs; decode steps (one pair per group) take
the BGMV decode kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import sgmv_triton
from kernels.moe_plan import ExpertPlan, expert_segments
from kernels.segments import SMALL_TILE_TOKENS, SegmentInfo
from kernels.triton_launch import check_launch


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # [P, K], rows sorted by expert
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]
    indptr_ptr,  # [E+1] int32
    N,
    K,
    stride_xp,
    stride_we,
    stride_wn,
    stride_op,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.load(indptr_ptr + e + 1)
    m0 = tl.load(indptr_ptr + e) + pid_m * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xp
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xk = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wk = tl.load(w_rows + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(xk.to(tl.float32), wk.to(tl.float32), input_precision=PRECISION)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_op + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def moe_grouped_gemm(
    x: torch.Tensor,  # [P, K], unit stride along K
    w: torch.Tensor,  # [E, N, K], unit stride along K
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    p, k = x.shape
    e, n, _ = w.shape
    out = torch.empty(p, n, dtype=x.dtype, device=x.device)
    check_launch("MoE GEMMs", _grouped_gemm_kernel, x, w, out)
    if p == 0:
        return out
    block_m = 16 if plan.max_rows <= SMALL_TILE_TOKENS else 64
    block_n, block_k = 64, 32
    grid = (e, triton.cdiv(plan.max_rows, block_m), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, w, out, plan.expert_indptr, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def expert_lora_shrink(
    x: torch.Tensor,  # [P, in], sorted pairs
    a: torch.Tensor,  # [num_slices, E * rows, in]: an expert A arena
    plan: ExpertPlan,
    seg: SegmentInfo,
    max_rank: int,
) -> torch.Tensor:  # [P, num_slices * R] float32
    """The SGMV shrink over the plan's (adapter, expert) groups (kernels.expert_segments)."""
    eseg = expert_segments(plan, seg, a.shape[1] // plan.num_experts)
    return sgmv_triton.lora_shrink(x, a, eseg, max_rank, None)


def expert_lora_expand(
    y: torch.Tensor,  # [P, out_total], updated in place
    inter: torch.Tensor,  # [P, num_slices * R] float32
    b: torch.Tensor,  # [out_total, E * rows]: an expert B arena
    plan: ExpertPlan,
    seg: SegmentInfo,
    slice_offsets: list[int],
) -> torch.Tensor:  # y
    eseg = expert_segments(plan, seg, b.shape[1] // plan.num_experts)
    return sgmv_triton.lora_expand(y, inter, b, eseg, slice_offsets)
