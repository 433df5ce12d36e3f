"""Torch attention, the CPU backend (and CUDA when forced): prefill, then paged decode.

## Prefill

Every call reaches a fused SDPA kernel with 4-D [1, heads, rows, hd] inputs and GQA
(enable_gqa), never SDPA's MATH fallback, which would hold fp32 [H, n, ctx] scores:

- the plain causal case (no window, no cap, ctx == n) is one SDPA call with is_causal;
- a plain chunk after earlier ones or prefix-cache hit (ctx > n: lower-right causal) is
  two calls of the CPU flash kernel SDPA itself runs, one over the ctx - n earlier
  positions (every row sees them all: no mask) and one causal over the chunk's own n,
  merged by their log-sum-exps. SDPA's public call returns no log-sum-exp, so this calls
  its CPU kernel's op; a mask instead would cost ~25 % more here (the CPU kernel skips
  no masked block and adds the mask to every score) and the masked path below is what
  runs where torch has no such op;
- the rest (a sliding window; ctx > n without the op) runs the queries in chunks, each
  one SDPA call over only the keys some row of the chunk sees, with a [rows, keys] bool
  mask: the mask, not a score matrix, is what a chunk adds, and a window also bounds each
  chunk's keys, so its work;
- attention sinks (gpt-oss: one more logit per head in the softmax, its probability
  dropped), which SDPA has no argument for, scale each row's plain attention by
  sigmoid(lse - sink), its share of the softmax's denominator: on the CPU the flash op
  above gives lse, over the whole causal prompt or chunk by chunk with an additive mask;
- soft-capped scores (Gemma 2), which SDPA cannot cap, and sinks where torch has no such
  op, are computed by hand chunk by chunk in fp32, each chunk's [H, rows, keys] bounded
  by CHUNK_BYTES.

On the CPU (torch 2.13) SDPA's flash kernel takes every one of these inputs, masks and
GQA included; kernels.attention_triton is the CUDA backend.

## Paged decode (vectorized)

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
import torch.nn.functional as F

# The most one query chunk may hold of masks or fp32 scores (sized for the CPU's caches
# and a bounded peak: an 8k-token prompt would otherwise need a 0.3 GB mask).
CHUNK_BYTES = 16 * 2**20
# SDPA's CPU flash kernel as an op that also returns its rows' log-sum-exp (natural log,
# [1, H, rows] fp32); None where this torch has no such op.
FLASH_CPU_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(
    q: torch.Tensor,  # [n, H, hd]
    k: torch.Tensor,  # [KVH, S, hd]
    v: torch.Tensor,  # [KVH, S, hd]
    scale: float,
    slots: torch.Tensor | None = None,  # [ctx] int64
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,  # [n, H, hd], q.dtype
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit
) -> torch.Tensor:  # [n, H, hd], q.dtype
    """See kernels.prefill_attention (arguments are checked there) and
    kernels.attention_reference."""
    if slots is not None:  # the positions' K/V out of the paged cache, in order
        k, v = k.index_select(1, slots), v.index_select(1, slots)  # [KVH, ctx, hd]
    n, ctx = q.shape[0], k.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, KVH, ctx, hd]
    window = None if sliding_window is None or sliding_window >= ctx else sliding_window
    flash_cpu = q.device.type == "cpu" and FLASH_CPU_WITH_LSE is not None
    if sinks is not None and soft_cap is None and flash_cpu:
        return _sunk(qh, kh, vh, scale, window, sinks, out)
    by_hand = soft_cap is not None or sinks is not None
    if window is None and not by_hand and ctx == n:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out.copy_(o[0].transpose(0, 1))
    if window is None and not by_hand and flash_cpu:
        return _earlier_then_causal(qh, kh, vh, scale, out)
    per_row = ctx * 4 * (q.shape[1] if by_hand else 1)  # bytes a row holds
    rows = max(16, CHUNK_BYTES // per_row)
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        first, last = ctx - n + i0, ctx - n + i1 - 1  # the chunk's query positions
        lo = 0 if window is None else max(0, first - window + 1)  # keys [lo, last] seen
        mask = _visible(first, i1 - i0, lo, last + 1, window, q.device)  # [rows, keys]
        keys, values = kh[:, :, lo : last + 1], vh[:, :, lo : last + 1]
        if by_hand:
            o = _by_hand(qh[0, :, i0:i1], keys[0], values[0], mask, scale, soft_cap, sinks)
        else:
            o = F.scaled_dot_product_attention(
                qh[:, :, i0:i1], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )[0]
        out[i0:i1] = o.transpose(0, 1)
    return out


def _earlier_then_causal(
    qh: torch.Tensor,  # [1, H, n, hd]
    kh: torch.Tensor,  # [1, KVH, ctx, hd], ctx > n
    vh: torch.Tensor,
    scale: float,
    out: torch.Tensor,  # [n, H, hd], q.dtype
) -> torch.Tensor:  # out
    """Lower-right causal attention as two flash calls: the earlier ctx - n positions
    (seen by every row) and the last n (causal), each weighted by its share of the
    softmax's denominator: the earlier part's is e^lse1 / (e^lse1 + e^lse2), i.e.
    sigmoid(lse1 - lse2), and the causal part's the rest. fp32 merges straight into
    `out` (no copy after: on a CPU one parallel region less)."""
    earlier = kh.shape[2] - qh.shape[2]
    o1, lse1 = FLASH_CPU_WITH_LSE(qh, kh[:, :, :earlier], vh[:, :, :earlier], scale=scale)[:2]
    o2, lse2 = FLASH_CPU_WITH_LSE(
        qh, kh[:, :, earlier:], vh[:, :, earlier:], is_causal=True, scale=scale
    )[:2]
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # [1, H, n, 1]
    merged = out.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd] view of out
    if o1.dtype == torch.float32:
        torch.lerp(o2, o1, w1, out=merged)  # o2 + w1 * (o1 - o2)
    else:
        merged.copy_(torch.lerp(o2.float(), o1.float(), w1))
    return out


def _sunk(
    qh: torch.Tensor,  # [1, H, n, hd]
    kh: torch.Tensor,  # [1, KVH, ctx, hd]
    vh: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,  # [H] fp32
    out: torch.Tensor,  # [n, H, hd], q.dtype
) -> torch.Tensor:  # out
    """Attention with sinks from the CPU flash op: each row's output and log-sum-exp,
    the output scaled by sigmoid(lse - sink) (e^lse / (e^lse + e^sink), the rows' share
    of the softmax once the sink joins it). A whole causal prompt is one call; a chunk
    after earlier positions or a window runs in query chunks over the keys they see,
    with an additive mask (the op's masks are of q's dtype)."""
    n, ctx = qh.shape[2], kh.shape[2]
    sink = sinks.float().view(1, -1, 1)  # [1, H, 1]
    if window is None and ctx == n:
        o, lse = FLASH_CPU_WITH_LSE(qh, kh, vh, is_causal=True, scale=scale)[:2]
        out.copy_((o.float() * torch.sigmoid(lse - sink)[..., None])[0].transpose(0, 1))
        return out
    rows = max(16, CHUNK_BYTES // (ctx * qh.element_size()))
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        first, last = ctx - n + i0, ctx - n + i1 - 1
        lo = 0 if window is None else max(0, first - window + 1)
        seen = _visible(first, i1 - i0, lo, last + 1, window, qh.device)
        mask = torch.zeros(seen.shape, dtype=qh.dtype, device=qh.device)
        mask.masked_fill_(~seen, float("-inf"))
        keys, values = kh[:, :, lo : last + 1], vh[:, :, lo : last + 1]
        o, lse = FLASH_CPU_WITH_LSE(qh[:, :, i0:i1], keys, values, attn_mask=mask, scale=scale)[:2]
        out[i0:i1] = (o.float() * torch.sigmoid(lse - sink)[..., None])[0].transpose(0, 1)
    return out


def _visible(
    first: int, rows: int, lo: int, hi: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[rows, hi - lo] bool: query r (position first + r) sees key position p in
    [lo, hi) when p <= first + r, and with a window when p > first + r - window."""
    t = torch.arange(first, first + rows, device=device)[:, None]
    p = torch.arange(lo, hi, device=device)[None, :]
    seen = p <= t
    if window is not None:
        seen &= p > t - window
    return seen


def _by_hand(
    qh: torch.Tensor,  # [H, rows, hd]
    k: torch.Tensor,  # [KVH, m, hd]
    v: torch.Tensor,  # [KVH, m, hd]
    mask: torch.Tensor,  # [rows, m] bool
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None,  # [H] fp32
) -> torch.Tensor:  # [H, rows, hd], q.dtype
    """Attention over one chunk in fp32: scale * q·k, capped to cap * tanh(s / cap)
    (Gemma 2), masked, softmax with each head's sink logit as one more entry whose
    probability is dropped (gpt-oss), then the values. The query heads of one kv head
    share its K/V (no copy of them)."""
    h, rows, hd = qh.shape
    kvh, g = k.shape[0], h // k.shape[0]
    qg = qh.float().reshape(kvh, g * rows, hd)  # [KVH, G*rows, hd]: heads h = kv*G + g
    scores = qg @ k.float().transpose(1, 2)  # [KVH, G*rows, m]
    if soft_cap is None:
        scores.mul_(scale)
    else:
        scores.mul_(scale / soft_cap).tanh_().mul_(soft_cap)
    scores = scores.view(kvh, g, rows, -1).masked_fill_(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float().view(kvh, g, 1, 1).expand(kvh, g, rows, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    o = probs.reshape(kvh, g * rows, -1) @ v.float()  # [KVH, G*rows, hd]
    return o.view(h, rows, hd).to(qh.dtype)


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
    kernels.attention_reference."""
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
