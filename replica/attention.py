"""Attention over the paged KV cache for a flattened batch of mixed decode and prefill.

Rows [0, num_decode) are decode tokens (one per sequence), attended in one
batched call over gathered blocks; each prefill (or prefill chunk) follows as
its own segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: (
        torch.Tensor
    )  # [T] int64: flat cache slot (block*block_size + offset) per new token
    num_decode: int  # host: number of decode sequences (= their tokens), rows [0, num_decode)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [D] int64: tokens in cache incl. the new one
    decode_max_context: int  # host: max of decode_context_lens
    prefill_starts: list[int]  # host: first row of each prefill segment
    prefill_lens: list[int]  # host: new tokens per prefill segment
    prefill_context_lens: list[int]  # host: tokens in cache after this step, per prefill segment
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int64, padded with 0


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, KVH, hd]
    v: torch.Tensor,  # [T, KVH, hd]
    k_cache: torch.Tensor,  # [NB, BS, KVH, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, H, hd]."""
    kvh, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decode:
        d = meta.num_decode
        out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale, sliding_window)
    for i, (start, n, ctx) in enumerate(
        zip(meta.prefill_starts, meta.prefill_lens, meta.prefill_context_lens)
    ):
        rows = slice(start, start + n)
        if ctx == n:  # whole prompt in this step: use the fresh K/V, skip the gather
            keys, values = k[rows], v[rows]
        else:
            table = meta.prefill_block_tables[i]
            keys = _gather(k_cache, table, ctx)
            values = _gather(v_cache, table, ctx)
        out[rows] = _prefill(q[rows], keys, values, ctx, scale, sliding_window)
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[ctx, KVH, hd] of one sequence from its block table."""
    nb = -(-ctx // cache.shape[1])
    return cache[table[:nb]].flatten(0, 1)[:ctx]


def _prefill(q, keys, values, ctx, scale, window) -> torch.Tensor:
    n = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [heads, L, hd]
    if ctx == n and window is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # [1, ctx]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _decode(q, k_cache, v_cache, meta, scale, window) -> torch.Tensor:
    bs = k_cache.shape[1]
    nb = -(-meta.decode_max_context // bs)
    tables = meta.decode_block_tables[:, :nb]  # [D, nb]
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [D, KVH, nb*bs, hd]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    pos = torch.arange(nb * bs, device=q.device).unsqueeze(0)  # [1, L]
    ctx = meta.decode_context_lens.unsqueeze(1)  # [D, 1]
    mask = pos < ctx
    if window is not None:
        mask &= pos >= ctx - window
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [D, H, 1, hd]
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
