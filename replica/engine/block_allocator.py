"""KV block bookkeeping: which blocks of the paged cache are free. Host-only (the
scheduler's); the tensors themselves are model/kv_cache.py's."""

from __future__ import annotations


class BlockAllocator:
    """Free list of KV blocks. Block ids are handed out lowest-first for locality."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields the lowest id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache: asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
