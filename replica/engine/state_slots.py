"""Which row of a hybrid model's linear-attention state pool each running sequence owns.

Host-only (the scheduler's), like the block allocator: the pool's tensors are
model/gated_deltanet.py's StatePool, one row per sequence that may run at once
(max_num_seqs) plus a scratch row past them that no sequence is handed (padding rows of
fixed-shape decode steps use it). A sequence takes a row when it is admitted and gives it
back when it finishes, is aborted or is preempted (a preempted sequence recomputes its
prompt, so its state starts again from zeros).
"""

from __future__ import annotations


class StateSlots:
    """A free list of state-pool rows [0, num_slots); `scratch` = num_slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() yields the lowest row
        self._held: set[int] = set()

    @property
    def scratch(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free row. Admission keeps running sequences within max_num_seqs = num_slots,
        so running out is the caller's bug."""
        if not self._free:
            raise MemoryError(f"state pool: all {self.num_slots} rows are held")
        row = self._free.pop()
        self._held.add(row)
        return row

    def release(self, row: int | None) -> None:
        """Give `row` back (None: the sequence held none)."""
        if row is None:
            return
        if row not in self._held:
            raise ValueError(f"state pool row {row} released but not held")
        self._held.remove(row)
        self._free.append(row)
