"""Which arena rows each resident adapter holds: aligned blocks of power-of-two rows.

The slot buffers keep adapter weights in arenas of rank rows (LoRASlotBuffers); an
adapter of rank r takes a block of block_rows(r) rows, the next power of two (at least
8), at an offset that is a multiple of its size. Aligned power-of-two
blocks (as in a buddy allocator) keep fragmentation bounded without moving anything: a
free region big enough for the largest rank is always a whole "top" block, and freeing
the occupants of one aligned region makes room for any rank up to its size.

Placement is a buddy allocator's best fit: a block goes where the free aligned block
around it is smallest, so larger free blocks stay whole for large ranks; among equal
fits, into the top block holding the most blocks of its size, so adapters of one rank
class tend to sit side by side (the CPU LoRA ops read neighbours of one rank as one
view). Host-only numpy bookkeeping: a few vector ops over the rows per call.
"""

from __future__ import annotations

import numpy as np

from replica.model.lora_slots import block_rows

FREE = -1


class RowArena:
    """Owner of every row (a slot index, or FREE) and the aligned blocks they form."""

    def __init__(self, num_rows: int, max_rank: int) -> None:
        self.top = block_rows(max(max_rank, 1))
        if num_rows <= 0 or num_rows % self.top:
            raise ValueError(
                f"{num_rows} arena rows: need a positive multiple of {self.top} "
                f"(one block of max_lora_rank {max_rank})"
            )
        self.num_rows = num_rows
        self.owner = np.full(num_rows, FREE, dtype=np.int32)
        self.size = np.zeros(num_rows, dtype=np.int32)  # each row's block size (0: free)

    @property
    def rows_used(self) -> int:
        return int(np.count_nonzero(self.owner != FREE))

    def free_top_blocks(self) -> int:
        """Whole top blocks nobody holds: loads of any rank that evict no one."""
        return int(np.count_nonzero((self.owner == FREE).reshape(-1, self.top).all(axis=1)))

    def find_free(self, size: int) -> int | None:
        """The first row of a free aligned block of `size` rows, packed (module docstring);
        None when there is none."""
        free = (self.owner == FREE).reshape(-1, size).all(axis=1)
        candidates = np.flatnonzero(free)
        if candidates.size == 0:
            return None
        if size >= self.top:
            return int(candidates[0]) * size
        free_rows = self.owner == FREE
        # the largest free aligned block around each candidate: the tightest fit keeps
        # larger free blocks whole (a buddy allocator's best fit)
        level = np.full(candidates.size, size)
        span = size * 2
        while span <= self.top:
            whole = free_rows.reshape(-1, span).all(axis=1)[candidates * size // span]
            level[whole] = span
            span *= 2
        same = (self.size == size).reshape(-1, self.top).sum(axis=1)  # rows of this size
        tops = candidates * size // self.top
        # tightest fit, then the top block with most rows of this size, then lowest offset
        best = np.lexsort((candidates, -same[tops], level))[0]
        return int(candidates[best]) * size

    def region_owners(self, start: int, size: int) -> set[int]:
        """The slots holding rows in [start, start + size)."""
        owners = self.owner[start : start + size]
        return {int(o) for o in np.unique(owners) if o != FREE}

    def cheapest_region(self, size: int, cost: np.ndarray) -> int | None:
        """The first row of the aligned region of `size` rows whose occupants are cheapest
        to evict: the region minimizing its dearest occupant's cost (`cost[slot]`; inf:
        may not be evicted), then its rows in use. None when every region holds one that
        may not be evicted."""
        row_cost = np.where(self.owner == FREE, -1.0, cost[np.maximum(self.owner, 0)])
        dearest = row_cost.reshape(-1, size).max(axis=1)
        ok = np.flatnonzero(np.isfinite(dearest))
        if ok.size == 0:
            return None
        used = (self.owner != FREE).reshape(-1, size).sum(axis=1)
        best = np.lexsort((ok, used[ok], dearest[ok]))[0]
        return int(ok[best]) * size

    def take(self, start: int, size: int, slot: int) -> None:
        block = slice(start, start + size)
        if size and (start % size or (self.owner[block] != FREE).any()):
            raise ValueError(f"rows [{start}, {start + size}) are not a free aligned block")
        self.owner[block] = slot
        self.size[block] = size

    def give_back(self, start: int, size: int) -> None:
        self.owner[start : start + size] = FREE
        self.size[start : start + size] = 0
