"""Slow, obviously-correct attention: the oracles for every fast path, prefill and paged
decode. Pure functions of their inputs (no config, no environment, no globals).

Prefill: one query row at a time, over exactly the keys that row may see.

Paged decode: unlike the fast paths it reads context_lens on the host (it is the
oracle, not a step of the engine).
"""

from __future__ import annotations

import torch


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


def paged_decode_attention_reference(
    q: torch.Tensor,  # [D, H, hd]
    k_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    v_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    block_tables: torch.Tensor,  # [D, W] int32
    context_lens: torch.Tensor,  # [D] int32, >= 1
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,  # > 0: Gemma 2's attention-logit soft cap
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [D, H, hd], q.dtype
    """Per sequence i with ctx = context_lens[i], attending positions p in
    [max(0, ctx - sliding_window), ctx) (all of [0, ctx) without a window), each held in
    cache slot block_tables[i, p // block_size] * block_size + p % block_size:

        s[p] = scale * q[i, h] · K[h // (H // KVH), p]
        s[p] = soft_cap * tanh(s[p] / soft_cap)      (only when soft_cap is not None)
        out[i, h] = softmax(s) @ V[h // (H // KVH), p]

    in float32, rounded once into q.dtype. Only the attended slots are read.
    """
    group = q.shape[1] // k_cache.shape[0]
    offsets = torch.arange(block_size, device=k_cache.device)
    out = torch.empty_like(q)
    for i, ctx in enumerate(context_lens.tolist()):
        lo = 0 if sliding_window is None else max(0, ctx - sliding_window)
        blocks = block_tables[i, : -(-ctx // block_size)].long()  # the ceil(ctx/bs) used
        slots = (blocks[:, None] * block_size + offsets).reshape(-1)[lo:ctx]  # [n]
        keys = k_cache[:, slots].float().repeat_interleave(group, 0)  # [H, n, hd]
        values = v_cache[:, slots].float().repeat_interleave(group, 0)  # [H, n, hd]
        scores = torch.einsum("hd,hnd->hn", q[i].float(), keys) * scale  # [H, n]
        if soft_cap is not None:  # Gemma 2: cap * tanh(s / cap), in fp32, before softmax
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[i] = torch.einsum("hn,hnd->hd", softmax_with_sinks(scores, sinks), values).to(q.dtype)
    return out


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of fp32 scores [H, ..., n], with head h's sink logit
    sinks[h] as one more entry whose probability is then dropped (None: plain softmax)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
