"""The model's paged attention over one mixed step: decode rows, a whole prompt, a chunk
after earlier ones and the rest of a prompt after a prefix-cache hit, against the kernels'
references over the cache the step wrote, with SDPA's MATH backend forbidden.

MATH is the slow path (fp32 [heads, n, ctx] scores); the fused backends (on the CPU,
flash) must take every prefill: whole prompt, chunked, prefix hit, GQA and windowed. The
soft-capped path, which no SDPA backend can take, must not hold those scores either.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import attention_torch
from kernels.attention_reference import (
    paged_decode_attention_reference,
    prefill_attention_reference,
)
from replica.model.decoder import AttentionMetadata, paged_attention

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
BLOCK = 4
HD = 16


def mixed_step(heads: tuple[int, int], seed: int = 0):
    """A cache holding each sequence's earlier tokens, the step's q/k/v rows, its metadata
    and per sequence (kind, rows, ctx, slots of positions 0..ctx-1)."""
    h, kvh = heads
    gen = torch.Generator().manual_seed(seed)
    # (kind, new tokens, context after the step)
    seqs = [("decode", 1, 23), ("decode", 1, 9), ("whole", 30, 30), ("chunk", 12, 40),
            ("prefix", 25, 41), ("whole", 3, 3)]  # fmt: skip
    blocks_needed = [-(-ctx // BLOCK) for _, _, ctx in seqs]
    num_blocks = sum(blocks_needed) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(kvh, num_blocks * BLOCK, HD, generator=gen)
    v_cache = torch.randn(kvh, num_blocks * BLOCK, HD, generator=gen)
    tables, layout, new_slots, row = [], [], [], 0
    for (kind, n, ctx), need in zip(seqs, blocks_needed):
        blocks, ids = ids[:need], ids[need:]
        tables.append(blocks)
        pos = torch.arange(ctx)
        slots = torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        layout.append((kind, slice(row, row + n), ctx, slots))
        new_slots.append(slots[ctx - n :])
        row += n
    q = torch.randn(row, h, HD, generator=gen)
    k = torch.randn(row, kvh, HD, generator=gen)
    v = torch.randn(row, kvh, HD, generator=gen)
    decodes = [x for x in layout if x[0] == "decode"]
    width = max(len(t) for t in tables)
    prefills = [x for x in layout if x[0] != "decode"]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots),
        num_decode=len(decodes),
        block_size=BLOCK,
        decode_block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables[: len(decodes)]], dtype=torch.int32
        ),
        decode_context_lens=torch.tensor([c for _, _, c, _ in decodes], dtype=torch.int32),
        prefill_starts=[r.start for _, r, _, _ in prefills],
        prefill_lens=[r.stop - r.start for _, r, _, _ in prefills],
        prefill_context_lens=[c for _, _, c, _ in prefills],
        prefill_slots=[None if kind == "whole" else s for kind, _, _, s in prefills],
    )
    return q, k, v, k_cache, v_cache, meta, layout


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_mixed_step_matches_references_on_fused_sdpa(heads, window, cap):
    q, k, v, k_cache, v_cache, meta, layout = mixed_step(heads, seed=len(heads) + (window or 0))
    scale = HD**-0.5
    with sdpa_kernel(FUSED):  # MATH off: a prefill that needs it raises
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale, window, cap)
    d = meta.num_decode
    want_decode = paged_decode_attention_reference(
        q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, BLOCK,
        scale, window, cap,
    )  # fmt: skip
    torch.testing.assert_close(out[:d], want_decode, rtol=1e-5, atol=1e-5)
    for kind, rows, _, slots in layout[d:]:
        want = prefill_attention_reference(q[rows], k_cache, v_cache, scale, slots, window, cap)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5, msg=kind)
    # the step's own K/V went into the cache first
    torch.testing.assert_close(k_cache[:, meta.slot_mapping], k.transpose(0, 1))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("cap", [None, 2.0], ids=["plain", "cap"])
@pytest.mark.parametrize("window", [None, 64])
def test_whole_prompt_holds_no_score_matrix(monkeypatch, window, cap):
    """A 256-token prompt over 8 heads: no op makes a tensor a quarter the size of its
    [8, 256, 256] scores (soft-capped attention in chunks of 16 rows here)."""
    monkeypatch.setattr(attention_torch, "CHUNK_BYTES", 16 * 8 * 256 * 4)
    gen = torch.Generator().manual_seed(1)
    n, h, kvh = 256, 8, 2
    q, k, v = (torch.randn(n, heads, HD, generator=gen) for heads in (h, kvh, kvh))
    k_cache, v_cache = torch.zeros(kvh, 2 * n, HD), torch.zeros(kvh, 2 * n, HD)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + n // 2, num_decode=0, block_size=BLOCK,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32), prefill_starts=[0],
        prefill_lens=[n], prefill_context_lens=[n], prefill_slots=[None],
    )  # fmt: skip
    with LargestTensor() as seen:
        out = paged_attention(q, k, v, k_cache, v_cache, meta, HD**-0.5, window, cap)
    assert seen.largest < h * n * n // 4, seen.largest
    want = prefill_attention_reference(q, k.transpose(0, 1), v.transpose(0, 1), HD**-0.5,
                                       None, window, cap)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_decode_splits_reach_the_kernel(monkeypatch):
    """AttentionMetadata.decode_splits is what the decode op gets (None by default)."""
    import kernels

    seen = []
    real = kernels.paged_decode_attention
    monkeypatch.setattr(
        kernels, "paged_decode_attention",
        lambda *a, **kw: seen.append(kw["num_splits"]) or real(*a, **kw),
    )  # fmt: skip
    q, k, v, k_cache, v_cache, meta, _ = mixed_step((8, 2))
    paged_attention(q, k, v, k_cache, v_cache, meta, HD**-0.5, None)
    meta.decode_splits = 4
    paged_attention(q, k, v, k_cache, v_cache, meta, HD**-0.5, None)
    assert seen == [None, 4]
