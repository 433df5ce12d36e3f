"""Fast torch path of paged decode attention: the CPU backend (and CUDA when forced).

Vectorized over sequences: every row's W * block_size table positions become cache
slots, one index_select per cache gathers them all, the fp32 scores are soft-capped
when asked (cap * tanh(s / cap)), and a masked fp32 softmax drops the positions outside
[max(0, ctx - window), ctx); attention sinks (gpt-oss) join that softmax as one more
logit per head. Every shape follows the table width W, never the values
in context_lens, and no device value is read on the host (no sync on CUDA). Masked
positions are redirected to the row's newest slot before the gather, so a slot the
contract says is never read (the tail of the last block, blocks past the context, blocks
before the window) is never read here either: its contents, NaN included, can't reach
an output through a zero weight (0 * NaN = NaN).
"""

from __future__ import annotations

import torch


def paged_decode_attention(
    q: torch.Tensor,  # [D, H, hd]
    k_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    v_cache: torch.Tensor,  # [KVH, num_blocks * block_size, hd]
    block_tables: torch.Tensor,  # [D, W] int32
    context_lens: torch.Tensor,  # [D] int32, 1 <= ctx <= W * block_size
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,  # > 0: Gemma 2's attention-logit soft cap
    out: torch.Tensor | None = None,  # [D, H, hd], q.dtype
    num_splits: int = 1,  # no effect: every position of every row is one vectorized pass
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [D, H, hd], q.dtype
    """See kernels.paged_decode_attention (arguments are checked there) and
    kernels.paged_attention_reference."""
    d, h, hd = q.shape
    kvh = k_cache.shape[0]
    if d == 0:
        return torch.empty_like(q) if out is None else out
    length = block_tables.shape[1] * block_size  # L: positions the table can address
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + offsets).view(d, length)  # [D, L]
    pos = torch.arange(length, device=q.device)  # [L]
    ctx = context_lens.long()[:, None]  # [D, 1]
    attended = pos < ctx  # [D, L]
    if sliding_window is not None:
        attended &= pos >= ctx - sliding_window
    newest = slots.gather(1, ctx - 1)  # [D, 1]: written this step, always attended
    slots = torch.where(attended, slots, newest)  # the gather reads no unattended slot

    # [KVH, D*L, hd] -> [KVH, D, L, hd]: batch over (kv head, sequence), no copy of K/V
    keys = k_cache.index_select(1, slots.view(-1)).view(kvh, d, length, hd).float()
    values = v_cache.index_select(1, slots.view(-1)).view(kvh, d, length, hd).float()
    qg = q.float().reshape(d, kvh, h // kvh, hd).transpose(0, 1)  # [KVH, D, G, hd]
    scores = qg @ keys.transpose(2, 3) * scale  # [KVH, D, G, L]
    if soft_cap is not None:  # cap * tanh(s / cap), on every score before the mask
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    scores.masked_fill_(~attended[None, :, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head, its probability dropped
        sink = sinks.float().view(kvh, 1, h // kvh, 1).expand(kvh, d, h // kvh, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :length]
    else:
        probs = scores.softmax(-1)
    o = probs @ values  # [KVH, D, G, hd]
    o = o.transpose(0, 1).reshape(d, h, hd)  # [D, H, hd], query head = kv head * G + g
    if out is None:
        return o.to(q.dtype)
    return out.copy_(o)
