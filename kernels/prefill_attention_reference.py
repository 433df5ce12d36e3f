"""Slow, obviously-correct prefill attention: the oracle for every fast path.

A pure function of its inputs (no config, no environment, no globals): one query row at a
time, over exactly the keys that row may see.
"""

from __future__ import annotations

import torch

from kernels.paged_attention_reference import softmax_with_sinks


def prefill_attention_reference(
    q: torch.Tensor,  # [n, H, hd]: the queries of the last n of ctx positions
    k: torch.Tensor,  # [KVH, S, hd]
    v: torch.Tensor,  # [KVH, S, hd]
    scale: float,
    slots: torch.Tensor | None = None,  # [ctx] int64: where position p's K/V are; None: p
    sliding_window: int | None = None,
    soft_cap: float | None = None,  # > 0: Gemma 2's attention-logit soft cap
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [n, H, hd], q.dtype
    """With ctx = len(slots) (k.shape[1] without slots), query row i sits at position
    t = ctx - n + i and sees positions p in [max(0, t - sliding_window + 1), t] (all of
    [0, t] without a window), each held at k[:, slots[p]] (k[:, p] without slots):

        s[p] = scale * q[i, h] · K[h // (H // KVH), p]
        s[p] = soft_cap * tanh(s[p] / soft_cap)      (only when soft_cap is not None)
        out[i, h] = softmax(s) @ V[h // (H // KVH), p]

    in float32, rounded once into q.dtype; with sinks, head h's softmax has one more
    logit sinks[h] whose probability is dropped (gpt-oss). Only the seen slots are read.
    """
    n, h, _ = q.shape
    group = h // k.shape[0]
    ctx = k.shape[1] if slots is None else slots.shape[0]
    where = torch.arange(ctx, device=k.device) if slots is None else slots
    out = torch.empty_like(q)
    for i in range(n):
        t = ctx - n + i
        lo = 0 if sliding_window is None else max(0, t - sliding_window + 1)
        seen = where[lo : t + 1]
        keys = k[:, seen].float().repeat_interleave(group, 0)  # [H, m, hd]
        values = v[:, seen].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hmd->hm", q[i].float(), keys) * scale  # [H, m]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = softmax_with_sinks(scores, sinks)
        out[i] = torch.einsum("hm,hmd->hd", probs, values).to(q.dtype)
    return out
