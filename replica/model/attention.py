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
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, H, hd]."""
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale, sliding_window, out=out[:d],
        )  # fmt: skip
    for start, n, ctx, slots in zip(
        meta.prefill_starts, meta.prefill_lens, meta.prefill_context_lens, meta.prefill_slots
    ):
        rows = slice(start, start + n)
        if ctx == n:  # whole prompt in this step: use the fresh K/V, skip the gather
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys, values = _gather(k_cache, slots), _gather(v_cache, slots)  # [KVH, ctx, hd]
        out[rows] = _prefill(q[rows], keys, values, ctx, scale, sliding_window)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[:, slots] for a [KVH, slots, hd] cache and slots of any shape. index_select
    over the flattened slots: on CPU ~50x faster than advanced indexing (measured 0.17 ms
    vs 8.9 ms for 32 sequences x 208 positions)."""
    out = cache.index_select(1, slots.reshape(-1))
    return out.view(cache.shape[0], *slots.shape, cache.shape[2])


def _prefill(q, keys, values, ctx, scale, window) -> torch.Tensor:
    """q: [n, H, hd]; keys/values: [KVH, ctx, hd]; the n queries are the last n positions."""
    n = q.shape[0]
    qh = q.transpose(0, 1)  # [H, n, hd]
    if ctx == n and window is None:
        o = F.scaled_dot_product_attention(
            qh, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # [1, ctx]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return o.transpose(0, 1)
