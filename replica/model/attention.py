"""Attention over the paged KV cache for a flattened batch of mixed decode and prefill.

Rows [0, num_decode) are decode tokens (one per sequence), attended in one call of
kernels.paged_decode_attention, which reads the block tables and context lengths on the
device (on a GPU no per-layer gather, and no shape that depends on the context); each
prefill (or prefill chunk) follows as its own segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block*block_size + offset) per new token
    num_decode: int  # host: number of decode sequences (= their tokens), rows [0, num_decode)
    block_size: int  # host: tokens per KV block
    decode_block_tables: torch.Tensor  # [D, W] int32: KV blocks of each decode sequence
    decode_context_lens: torch.Tensor  # [D] int32: tokens in cache incl. the new one
    prefill_starts: list[int]  # host: first row of each prefill segment
    prefill_lens: list[int]  # host: new tokens per prefill segment
    prefill_context_lens: list[int]  # host: tokens in cache after this step, per prefill segment
    prefill_slots: list[torch.Tensor | None]  # per prefill: [ctx] int64 slots; None if ctx == n


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, KVH, hd]
    v: torch.Tensor,  # [T, KVH, hd]
    k_cache: torch.Tensor,  # [KVH, slots, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend (scores scale·q·k, capped to
    soft_cap·tanh(s/soft_cap) when given). Returns [T, H, hd]."""
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale, sliding_window, soft_cap=soft_cap, out=out[:d],
        )  # fmt: skip
    for start, n, ctx, slots in zip(
        meta.prefill_starts, meta.prefill_lens, meta.prefill_context_lens, meta.prefill_slots
    ):
        rows = slice(start, start + n)
        if ctx == n:  # whole prompt in this step: use the fresh K/V, skip the gather
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys, values = _gather(k_cache, slots), _gather(v_cache, slots)  # [KVH, ctx, hd]
        out[rows] = _prefill(q[rows], keys, values, ctx, scale, sliding_window, soft_cap)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[:, slots] for a [KVH, slots, hd] cache and slots of any shape. index_select
    over the flattened slots: on CPU ~50x faster than advanced indexing (measured 0.17 ms
    vs 8.9 ms for 32 sequences x 208 positions)."""
    out = cache.index_select(1, slots.reshape(-1))
    return out.view(cache.shape[0], *slots.shape, cache.shape[2])


def _prefill(q, keys, values, ctx, scale, window, soft_cap) -> torch.Tensor:
    """q: [n, H, hd]; keys/values: [KVH, ctx, hd]; the n queries are the last n positions."""
    n = q.shape[0]
    qh = q.transpose(0, 1)  # [H, n, hd]
    if soft_cap is not None:  # SDPA has no cap: scores by hand, in fp32
        return _capped_prefill(qh, keys, values, ctx, scale, window, soft_cap).transpose(0, 1)
    if ctx == n and window is None:
        o = F.scaled_dot_product_attention(
            qh, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        mask = _causal_mask(n, ctx, window, q.device)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return o.transpose(0, 1)


def _causal_mask(n: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: query i (position ctx - n + i) sees keys p <= its position, and with a
    window only the last `window` of them."""
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)  # [1, ctx]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _capped_prefill(qh, keys, values, ctx, scale, window, soft_cap) -> torch.Tensor:
    """Gemma 2's attention: scores = cap·tanh(scale·q·k / cap), masked, softmax in fp32.
    qh: [H, n, hd]; keys/values: [KVH, ctx, hd] -> [H, n, hd]."""
    group = qh.shape[0] // keys.shape[0]
    k = keys.float().repeat_interleave(group, 0)  # [H, ctx, hd]
    v = values.float().repeat_interleave(group, 0)
    scores = (qh.float() @ k.transpose(1, 2)) * scale  # [H, n, ctx]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    mask = _causal_mask(qh.shape[1], ctx, window, qh.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).to(qh.dtype)
