"""Continuous batching: which sequences run this step, and how many tokens each.

Host-only: the scheduler never touches a tensor. Budgets per step: tokens
(prefill chunks + decodes), sequences, KV blocks, and distinct adapters.
A waiting request whose adapter is not in a device slot is skipped, not
waited on: later requests (and every base request) are still admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from replica.kv_cache import BlockAllocator, blocks_needed
from replica.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    """This step's work: decodes first (one token each), then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each sequence runs this step
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def ordered(self) -> list[tuple[Sequence, int]]:
        pairs = list(zip(self.seqs, self.num_new))
        return [p for p in pairs if p[1] == 1] + [p for p in pairs if p[1] != 1]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras_per_batch: int,
        slot_of: Callable[[str], int | None],
    ) -> None:
        self.allocator, self.block_size = allocator, block_size
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.max_loras = max_loras_per_batch
        self.slot_of = slot_of  # adapter name -> device slot if ready, else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_tokens
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below while making room for an older sequence
            n = min(seq.num_pending, budget)
            if n == 0:
                continue
            if not self._grow(seq, n, batch):
                continue
            batch.add(seq, n)
            budget -= n
        self._admit(batch, budget)
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.allocator.free(seq.blocks)
        seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        adapters = {s.adapter for s in self.running if s.adapter is not None}
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if seq.adapter is not None:
                slot = self.slot_of(seq.adapter)
                if slot is None:
                    continue  # adapter not resident yet: skip, don't block
                if seq.adapter not in adapters and len(adapters) >= self.max_loras:
                    continue
            else:
                slot = 0
            n = min(seq.num_pending, budget)
            need = blocks_needed(seq.num_computed + n, self.block_size) - len(seq.blocks)
            if need > self.allocator.num_free:
                return  # KV cache full: wait (FCFS) rather than overcommit
            seq.blocks += self.allocator.allocate(need)
            seq.slot, seq.status = slot, SeqStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            batch.add(seq, n)
            budget -= n

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Ensure KV blocks for n more tokens, preempting the youngest others if needed."""
        need = blocks_needed(seq.num_computed + n, self.block_size) - len(seq.blocks)
        while need > self.allocator.num_free:
            victim = max(
                (s for s in self.running if s is not seq and s not in batch.seqs),
                key=lambda s: s.arrival,
                default=None,
            )
            if victim is None or victim.arrival < seq.arrival:
                self._preempt(seq, batch)
                return False
            self._preempt(victim, batch)
        seq.blocks += self.allocator.allocate(need)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free a sequence's KV and requeue it at the front; it recomputes later."""
        self.allocator.free(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        self.waiting.sort(key=lambda s: s.arrival)
        batch.preempted.append(seq)
