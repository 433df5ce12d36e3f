"""Attention over the paged KV cache for a flattened batch of mixed decode and prefill.

Rows [0, num_decode) are decode tokens (one per sequence), attended in one call of
kernels.paged_decode_attention, which reads the block tables and context lengths on the
device (on a GPU no per-layer gather, and no shape that depends on the context); each
prefill (or prefill chunk) follows as its own segment, one call of
kernels.prefill_attention each: a whole prompt attends to its fresh K/V, a chunk after
earlier ones or the rest of a prompt after a prefix-cache hit to the cache through its
slots (lower-right causal). Both ops take the layer's window and soft cap, and every path
they take is fused or chunked: none holds a [heads, n, ctx] score matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    # host: programs sharing each decode sequence's context (kernels.decode_splits); None:
    # chosen from the block table's width
    decode_splits: int | None = None


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor | None,  # [T, KVH, hd]; None: already in the cache (see below)
    v: torch.Tensor | None,  # [T, KVH, hd]
    k_cache: torch.Tensor,  # [KVH, slots, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend (scores scale·q·k, capped to
    soft_cap·tanh(s/soft_cap) when given; sinks join each head's softmax). Returns
    [T, H, hd]. k and v None: an earlier layer already wrote this step's K/V into these
    caches (Gemma 4's KV-sharing layers), so nothing is written and a whole prompt's keys
    are read back from its slots."""
    if k is not None:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    d = meta.num_decode
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale, sliding_window, soft_cap=soft_cap, out=out[:d],
            num_splits=meta.decode_splits, sinks=sinks,
        )  # fmt: skip
    for start, n, slots in zip(meta.prefill_starts, meta.prefill_lens, meta.prefill_slots):
        rows = slice(start, start + n)
        if slots is None and k is None:  # whole prompt, its K/V written by another layer
            fresh = meta.slot_mapping[rows]
            keys, values = k_cache.index_select(1, fresh), v_cache.index_select(1, fresh)
        elif slots is None:  # whole prompt in this step: its fresh K/V, no gather
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, n, hd]
        else:
            keys, values = k_cache, v_cache
        kernels.prefill_attention(
            q[rows], keys, values, scale, slots, sliding_window, soft_cap, out=out[rows],
            sinks=sinks,
        )  # fmt: skip
    return out
