"""Prefill-attention test cases: random queries over dense or paged keys and values, the
fp32 copies the oracles read, and the tolerances per dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.conftest import TEST_DEVICE

NAN = float("nan")


HD = 16


TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class Case:
    q: torch.Tensor  # [n, H, hd]
    k: torch.Tensor  # [KVH, S, hd]: fresh rows seen transposed, or the cache
    v: torch.Tensor
    slots: torch.Tensor | None  # [ctx] int64 into the cache; None: fresh
    window: int | None
    soft_cap: float | None
    keys: torch.Tensor  # dense [KVH, ctx, hd] fp32, every position
    values: torch.Tensor

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.scale, self.slots, self.window, self.soft_cap)


def make_case(
    n: int,
    ctx: int,
    heads: tuple[int, int] = (8, 2),
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    soft_cap: float | None = None,
    paged: bool | None = None,  # default: paged exactly when ctx > n
    block_size: int = 4,
    seed: int = 0,
    hd: int = HD,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads
    keys = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
    values = torch.randn(kvh, ctx, hd, generator=gen).to(dtype).float()
    q = torch.randn(n, h, hd, generator=gen).to(TEST_DEVICE, dtype)
    paged = ctx > n if paged is None else paged
    if not paged:  # [n, KVH, hd] rows, seen as [KVH, n, hd]: what the model passes
        k = keys.transpose(0, 1).contiguous().to(TEST_DEVICE, dtype).transpose(0, 1)
        v = values.transpose(0, 1).contiguous().to(TEST_DEVICE, dtype).transpose(0, 1)
        return Case(q, k, v, None, window, soft_cap, keys, values)
    need = -(-ctx // block_size)
    num_blocks = need + 2  # two spare blocks, NaN
    ids = torch.randperm(num_blocks, generator=gen)[:need]
    pos = torch.arange(ctx)
    slots = ids[pos // block_size] * block_size + pos % block_size
    first_seen = 0 if window is None else max(0, ctx - n - window + 1)
    k_cache = torch.full((kvh, num_blocks * block_size, hd), NAN)
    v_cache = torch.full_like(k_cache, NAN)
    k_cache[:, slots[first_seen:]] = keys[:, first_seen:]
    v_cache[:, slots[first_seen:]] = values[:, first_seen:]
    return Case(
        q, k_cache.to(TEST_DEVICE, dtype), v_cache.to(TEST_DEVICE, dtype),
        slots.to(TEST_DEVICE), window, soft_cap, keys, values,
    )  # fmt: skip
