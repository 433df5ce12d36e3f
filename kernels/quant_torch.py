"""Torch path of the quantized GEMMs: the CPU backend (CUDA when forced).

A weight is dequantized one tile of output rows at a time (the format's
`dequantize_rows`, the same code as the oracle, ~2 MiB of float32) and multiplied at once, so
at most one tile of W is ever dense: memory stays bounded whatever the layer, and the
tile stays in cache while the matmul reads it. Activations are never quantized
(W8A16 / W4A16): each tile is rounded into x.dtype and multiplied there (fp32
accumulation inside the matmul), as the Triton kernels multiply bf16 tiles on tensor
cores; fp32 inputs stay exact.

Mixture-of-experts layers run each expert's sorted rows through the same tiles (its
expert bounds read on the host: free on CPU); graph-safe plans (a fixed-shape decode
step) run every expert over every row and keep each row's own, no device value read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_plan import ExpertPlan
from kernels.quant_formats import QuantizedWeight

# Dense float32 bytes one tile of W may take: about what the cache holds while the
# matmul reads the tile back (larger tiles spill; docs/performance.md has the sweep).
TILE_BYTES = 2 << 20


def tile_rows(w: QuantizedWeight) -> int:
    """Rows of W per tile: TILE_BYTES of float32, a multiple of 8 (packed zero points hold
    8 rows a word), at least 8."""
    return max(8, TILE_BYTES // (4 * w.shape[1]) // 8 * 8)


def quant_linear(
    x: torch.Tensor,  # [M, K]
    w: QuantizedWeight,  # one matrix, W [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act_fp8: bool = False,
) -> torch.Tensor:  # [M, N], x.dtype
    if act_fp8:
        raise ValueError("quant_linear: act_fp8 (W8A8) runs on the Triton path only")
    return _linear_rows(x, w, bias, None)


def quant_moe_gemm(
    x: torch.Tensor,  # [P, K], rows sorted by expert
    w: QuantizedWeight,  # stacked experts, W [E, N, K]
    plan: ExpertPlan,
) -> torch.Tensor:  # [P, N], x.dtype
    if plan.graph_safe:
        out = torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        for e in range(plan.num_experts):
            mine = (plan.experts == e)[:, None]
            out = torch.where(mine, _linear_rows(x, w, None, e), out)
        return out
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    bounds = plan.expert_indptr.tolist()  # host read: free on CPU
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi > lo:
            out[lo:hi] = _linear_rows(x[lo:hi], w, None, e)
    return out


def _linear_rows(
    x: torch.Tensor,  # [M, K]
    w: QuantizedWeight,
    bias: torch.Tensor | None,  # [N]
    expert: int | None,
) -> torch.Tensor:  # [M, N] x.dtype
    n = w.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    step = tile_rows(w)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        b = None if bias is None else bias[n0:n1].to(x.dtype)
        out[:, n0:n1] = F.linear(x, w.dequantize_rows(n0, n1, expert).to(x.dtype), b)
    return out
