"""Paged-attention test cases: random queries over a paged KV cache, the dense keys and
values they stand for, and context lengths that cross block edges."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tests.conftest import TEST_DEVICE

HD = 16  # head dim
NAN = float("nan")  # what the spare blocks hold: a read of one shows


@dataclass
class Case:
    q: torch.Tensor  # [D, H, hd]
    k_cache: torch.Tensor  # [KVH, num_blocks * block_size, hd]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [D, W] int32
    context_lens: torch.Tensor  # [D] int32
    block_size: int
    window: int | None
    keys: list[torch.Tensor | None]  # per row: dense [KVH, ctx, hd] fp32 (None: padding row)
    values: list[torch.Tensor | None]
    real: torch.Tensor  # [D] bool: rows that are not padding
    soft_cap: float | None = None

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.block_size,
            self.scale,
            self.window,
            self.soft_cap,
        )


def make_case(
    ctx_lens: list[int],  # one per sequence; None marks a padding row (ctx 1, scratch block)
    block_size: int,
    heads: tuple[int, int] = (8, 2),  # (H, KVH)
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
    hd: int = HD,
    soft_cap: float | None = None,
) -> Case:
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads
    need = [-(-(c or 1) // block_size) for c in ctx_lens]  # blocks each row uses
    real_blocks = sum(n for n, c in zip(need, ctx_lens) if c is not None)
    num_blocks = real_blocks + 3  # + the scratch block and two spare ones, all NaN
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    scratch, spares, ids = ids[0], ids[1:3], ids[3:]
    width = max(need) + 2  # every row has unused table entries

    k_cache = torch.full((kvh, num_blocks * block_size, hd), NAN)
    v_cache = torch.full_like(k_cache, NAN)
    table = torch.empty(len(ctx_lens), width, dtype=torch.int32)
    keys, values = [], []
    for i, (ctx, n) in enumerate(zip(ctx_lens, need)):
        if ctx is None:  # padding row: every entry the scratch block
            table[i] = scratch
            keys.append(None)
            values.append(None)
            continue
        blocks, ids = ids[:n], ids[n:]
        # unused entries point at NaN blocks and at other rows' blocks alike
        unused = [rnd.choice(spares + [scratch]) if j % 2 else rnd.randrange(num_blocks)
                  for j in range(width - n)]  # fmt: skip
        table[i] = torch.tensor(blocks + unused)
        k = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
        v = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(ctx)])  # fmt: skip
        lo = 0 if window is None else max(0, ctx - window)  # before it: left NaN, never read
        k_cache[:, slots[lo:]] = k[:, lo:]
        v_cache[:, slots[lo:]] = v[:, lo:]
        keys.append(k)
        values.append(v)
    lens = [1 if c is None else c for c in ctx_lens]
    return Case(
        q=torch.randn(len(ctx_lens), h, hd, generator=gen).to(TEST_DEVICE, dtype),
        k_cache=k_cache.to(TEST_DEVICE, dtype),
        v_cache=v_cache.to(TEST_DEVICE, dtype),
        block_tables=table.to(TEST_DEVICE),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=TEST_DEVICE),
        block_size=block_size,
        window=window,
        keys=keys,
        values=values,
        real=torch.tensor([c is not None for c in ctx_lens], device=TEST_DEVICE),
        soft_cap=soft_cap,
    )


# ctx 1, exact block boundaries (k*bs, k*bs + 1) and ones in between, padding rows between
def mixed_lens(block_size: int) -> list[int | None]:
    bs = block_size
    return [1, bs, bs + 1, None, 3 * bs, 3 * bs + 1, 2 * bs + bs // 2 + 1, None, 37, 70]
