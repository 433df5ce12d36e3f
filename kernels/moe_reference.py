"""Slow, obviously-correct mixture-of-experts ops: the oracle for every fast path.

Pure functions of their inputs: no config, no environment, no globals.
"""

from __future__ import annotations

import torch


def moe_grouped_gemm_reference(
    x: torch.Tensor, w: torch.Tensor, expert_indptr: torch.Tensor
) -> torch.Tensor:
    """Semantics, for each expert e and row i in [expert_indptr[e], expert_indptr[e+1]):

        out[i] = x[i].float() @ w[e].float()ᵀ   rounded once into x.dtype

    x: [P, K], rows sorted by expert; w: [E, N, K] stacked experts. Rows of no expert
    (past expert_indptr[E]) are zero.
    """
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    bounds = expert_indptr.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = (x[lo:hi].float() @ w[e].float().T).to(x.dtype)
    return out


def expert_lora_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    pair_slots: torch.Tensor,
    pair_experts: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scalings: torch.Tensor,
    slot_offsets: torch.Tensor,
    rows_per_expert: int,
    slice_offsets: list[int],
) -> torch.Tensor:
    """Semantics, per row i with slot s = pair_slots[i] != 0, expert e = pair_experts[i],
    r = slot_ranks[s], o = slot_offsets[s] + e * rows_per_expert, per slice j with output
    columns cols_j = [slice_offsets[j], slice_offsets[j+1]):

        delta[i, cols_j] = scaling[s] * (x[i] @ a[j, o : o+r]ᵀ) @ b[cols_j, o : o+r]ᵀ

    x: [P, in]; a: [num_slices, E * rows_per_expert, in] and b: [out, E * rows_per_expert],
    the expert arenas. Returns delta [P, out] float32 (zero for slot-0 rows).
    """
    delta = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float32, device=x.device)
    ranks, offsets = slot_ranks.tolist(), slot_offsets.tolist()
    scalings = slot_scalings.tolist()
    for i, (s, e) in enumerate(zip(pair_slots.tolist(), pair_experts.tolist())):
        if s == 0 or ranks[s] == 0:
            continue
        r, o = ranks[s], offsets[s] + e * rows_per_expert
        for j in range(len(slice_offsets) - 1):
            c0, c1 = slice_offsets[j], slice_offsets[j + 1]
            inter = x[i].float() @ a[j, o : o + r].float().T
            delta[i, c0:c1] = scalings[s] * (inter @ b[c0:c1, o : o + r].float().T)
    return delta
