"""Continuous batching: which sequences run this step, and how many tokens each.

Host-only: the scheduler never touches a tensor. Budgets per step: tokens
(prefill chunks + decodes), sequences, KV blocks, distinct adapters, and
adapter readiness. A waiting request whose adapter is not in a device slot
(or would exceed max_loras_per_batch) is skipped, not waited on: later
requests, and every base request, are still admitted. A request skipped
`aging_steps` times starves no longer: other adapters' requests are held
back behind it (base requests are not) until its own adapter gets a slot.

In which order waiting requests are considered is the admission policy's (FCFS
below, or engine/fair_share.py's VTC fair share between tenants); the budgets
above, skip-not-block and aging hold under either.

plan_step, at the end, turns a step's scheduled work into the BatchPlan of host ints
that the executor (and, under tensor parallelism, every rank) builds the batch from.

With prefix caching a waiting request starts after its longest cached prefix: those
blocks are shared, not allocated, and cost KV budget only if nobody else holds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from replica.adapters.slot_pool import AdapterSlotPool
from replica.engine.kv_blocks import BlockAllocator, PrefixCache, blocks_needed
from replica.engine.sequence import SeqStatus, Sequence
from replica.engine.state_slots import StateSlots
from replica.executor.batch import BatchPlan


class AdmissionPolicy(Protocol):
    def arrived(
        self, seq: Sequence, weight: float, waiting: list[Sequence], running: list[Sequence]
    ) -> None:
        """A new request, before it joins `waiting` (the queues as they are)."""

    def candidates(
        self, waiting: list[Sequence], running: list[Sequence] = ()
    ) -> Iterator[Sequence]:
        """Waiting requests in the order to consider them; the next one is chosen after
        the caller has handled (admitted or skipped) the previous."""

    def admitted(self, seq: Sequence, uncached_prompt_tokens: int) -> None:
        """`seq` starts running; it will compute this many prompt tokens not cached."""

    def generated(self, seq: Sequence) -> None:
        """`seq` drew one output token."""

    def counters(self) -> dict[str | None, float]:
        """Each tenant's counter (empty for a policy that keeps none)."""

    def lags(self, waiting: list[Sequence], running: list[Sequence]) -> dict[str | None, float]:
        """How far each tenant's counter is above that of the tenant served next (its
        counter as a request arriving now would have it); tenants at 0 are left out."""


class FCFS:
    """Arrival order; keeps no counters."""

    def arrived(
        self, seq: Sequence, weight: float, waiting: list[Sequence], running: list[Sequence]
    ) -> None:
        pass

    def candidates(
        self, waiting: list[Sequence], running: list[Sequence] = ()
    ) -> Iterator[Sequence]:
        return iter(list(waiting))

    def admitted(self, seq: Sequence, uncached_prompt_tokens: int) -> None:
        pass

    def generated(self, seq: Sequence) -> None:
        pass

    def counters(self) -> dict[str | None, float]:
        return {}

    def lags(self, waiting: list[Sequence], running: list[Sequence]) -> dict[str | None, float]:
        return {}


@dataclass
class ScheduledBatch:
    """This step's work: (sequence, new tokens) pairs."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    def ordered(self) -> list[tuple[Sequence, int]]:
        """Decodes (one token) first, as batch preparation and attention expect; within
        each group by adapter slot, so every adapter's tokens are one contiguous row range
        (the LoRA kernels then read views instead of gathering rows)."""
        pairs = sorted(zip(self.seqs, self.num_new), key=lambda p: p[0].slot)
        return [p for p in pairs if p[1] == 1] + [p for p in pairs if p[1] != 1]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        pool: AdapterSlotPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras_per_batch: int,
        aging_steps: int,
        prefix_caching: bool = False,
        policy: AdmissionPolicy | None = None,
        states: StateSlots | None = None,
    ) -> None:
        """`states`: a hybrid model's state-pool rows, one taken by each running sequence."""
        self.allocator, self.pool, self.block_size = allocator, pool, block_size
        self.prefix = PrefixCache(allocator, block_size, prefix_caching)
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.max_loras, self.aging_steps = max_loras_per_batch, aging_steps
        self.policy = policy or FCFS()
        self.states = states
        # (parent row, child row) of choices forked since the last forward: the next
        # forward copies them first (no forward writes a row in between)
        self.state_copies: list[tuple[int, int]] = []
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, weight: float = 1.0) -> None:
        """Queue a request; `weight` is its tenant's fair-share weight."""
        self.policy.arrived(seq, weight, self.waiting, self.running)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_tokens
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below to make room for an older sequence
            n = min(seq.num_pending, budget)
            if n and self._grow(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        self._admit(batch, budget)
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length, abort, error) and free its KV and slot reference."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.pool.release(seq.slot)
            self._release_state(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def fork(self, parent: Sequence, children: list[Sequence]) -> tuple[list[int], list[int]]:
        """Choices forking from `parent`'s prefill (its KV computed this step; each child
        holds its first token). Those that fit now (free blocks, max_num_seqs) run with
        copies of the parent's blocks; the others wait like preempted sequences and
        recompute their prompt: never more blocks than are free. A child shares the
        parent's full blocks (they never change again) and gets a copy of its last, partly
        filled one. Returns the (src, dst) block copies the executor must make."""
        src: list[int] = []
        dst: list[int] = []
        full = parent.num_computed // self.block_size
        shared, partial = parent.blocks[:full], parent.blocks[full:]
        for child in children:
            if len(partial) > self.allocator.num_free or len(self.running) >= self.max_num_seqs:
                child.status = SeqStatus.WAITING
                self.waiting.append(child)
                self.waiting.sort(key=lambda s: s.arrival)
                continue
            self.allocator.share(shared)
            copies = self.allocator.allocate(len(partial))
            child.blocks = shared + copies
            child.num_computed = parent.num_computed
            child.block_keys = list(parent.block_keys)
            child.num_cached_blocks = min(parent.num_cached_blocks, full)
            child.num_cached_tokens = parent.num_cached_tokens
            child.slot, child.status = parent.slot, SeqStatus.RUNNING
            if self.states is not None:
                child.state_slot = self.states.acquire()
                self.state_copies.append((parent.state_slot, child.state_slot))
            self.pool.acquire(child.slot)
            self.running.append(child)
            src += partial
            dst += copies
        return src, dst

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        running = {s.lora_key for s in self.running if s.lora_key is not None}
        priority: str | None = None  # adapter of the oldest request skipped too often
        for seq in self.policy.candidates(self.waiting, self.running):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            slot = self._slot_for(seq, running, priority)
            if slot is None:
                seq.skips += 1
                if seq.skips >= self.aging_steps and priority is None:
                    priority = seq.lora_key
                continue  # skip, don't block
            hits = self.prefix.lookup(seq)  # a waiting sequence holds no blocks
            cached = len(hits) * self.block_size
            n = min(seq.num_tokens - cached, budget)
            need = blocks_needed(cached + n, self.block_size) - len(hits)
            if need + self.allocator.unreferenced(hits) > self.allocator.num_free:
                return  # KV cache full: wait in arrival order rather than overcommit
            self.allocator.share(hits)
            seq.blocks = hits + self.allocator.allocate(need)
            seq.num_computed = cached
            first = seq.num_cached_tokens is None  # not a recompute, nor a forked choice
            self.prefix.admitted(seq, hits)
            if first:
                self.policy.admitted(seq, len(seq.prompt_ids) - seq.num_cached_tokens)
            self.pool.acquire(slot)
            seq.slot, seq.status = slot, SeqStatus.RUNNING
            if self.states is not None:
                seq.state_slot = self.states.acquire()
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.lora_key is not None:
                running.add(seq.lora_key)
            batch.add(seq, n)
            budget -= n

    def _slot_for(self, seq: Sequence, running: set[str], priority: str | None) -> int | None:
        """The slot seq would run on now, or None if it must be skipped this step."""
        key = seq.lora_key
        if key is None:
            return 0  # the pinned base slot: always admissible
        if priority is not None and key != priority:
            return None  # an older request has waited too long: only its adapter (or base) runs
        slot = self.pool.ready_slot(key)
        if slot is None or key in running:
            return slot
        return None if len(running) >= self.max_loras else slot

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
        """Free a sequence's KV and slot reference; it waits again and recomputes later
        (from what of it stayed cached)."""
        self.allocator.free(seq.blocks)
        self.pool.release(seq.slot)
        self._release_state(seq)
        seq.blocks, seq.num_computed, seq.num_cached_blocks = [], 0, 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.arrival)
        self.num_preemptions += 1

    def _release_state(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None


# -- batch preparation's host half: the plan a tensor-parallel rank 0 broadcasts -------------


def plan_step(
    work: list[tuple[Sequence, int]], block_size: int
) -> tuple[BatchPlan, list[Sequence], list[tuple[Sequence, range]]]:
    """The plan of `work` ((sequence, new tokens), decodes first), the sequences whose
    logits it samples, in row order, and the prompt positions it scores: (sequence,
    positions) of prefills whose request asked for prompt logprobs. The plan's logit rows
    are the sampled rows, then the scored positions' rows in that order."""
    plan = BatchPlan([], [], [0], [], [], [], [], [], [], [], [], [])
    sampled, scored, scored_rows = [], [], []
    for seq, n in work:
        start, ctx = seq.num_computed, seq.num_computed + n
        plan.input_ids += seq.token_slice(start, ctx)
        plan.positions += range(start, ctx)
        row0 = plan.seg_indptr[-1]
        plan.seg_indptr.append(row0 + n)
        plan.seg_slots.append(seq.slot)
        if seq.state_slot is not None:  # a hybrid model: its state row, from zeros at first
            plan.state_slots.append(seq.state_slot)
            plan.state_initial.append(start > 0)
        if n == 1 and not plan.prefill_starts:
            plan.decode_tables.append(seq.blocks)
            plan.decode_context_lens.append(ctx)
            plan.decode_new_slots.append(
                seq.blocks[start // block_size] * block_size + start % block_size
            )
        else:
            plan.prefill_starts.append(row0)
            plan.prefill_lens.append(n)
            plan.prefill_context_lens.append(ctx)
            plan.prefill_tables.append(seq.blocks)
        if ctx == seq.num_tokens:
            plan.logit_rows.append(row0 + n - 1)
            sampled.append(seq)
        group = seq.group
        positions = group.prompt_logprob_positions(seq, start, ctx) if group else range(0)
        if positions:
            scored.append((seq, positions))
            scored_rows += (row0 + p - start for p in positions)
    plan.logit_rows += scored_rows
    return plan, sampled, scored
