"""Property test of the block bookkeeping under prefix caching (no model: the scheduler
and allocator are host-only). Random interleavings of add / step / finish / abort /
unload / allocate-pressure never leave a block both free and referenced, a count
negative or wrong, or a cached key that does not lead back to its block."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replica.adapters.slot_pool import AdapterSlotPool, make_policy
from replica.engine.kv_blocks import BlockAllocator
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import SeqStatus, Sequence, SequenceGroup
from replica.wire import GenerateRequest, SamplingParams

BS, NUM_BLOCKS = 4, 24
PREFIXES = [[(7 * p + i) % 50 + 3 for i in range(13)] for p in range(3)]  # 3 full blocks each
IDENTITIES = ["", "a#1", "b#2"]


class BlockBookkeeping(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        pool = AdapterSlotPool(2, make_policy("lru"))
        self.sched = Scheduler(
            BlockAllocator(NUM_BLOCKS), pool, BS, max_num_seqs=4, max_num_batched_tokens=12,
            max_loras_per_batch=1, aging_steps=8, prefix_caching=True,
        )  # fmt: skip
        self.arrivals = 0
        self.live: list[Sequence] = []
        self.held: list[list[int]] = []  # blocks taken outside the scheduler (offline score)

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        cut=st.integers(1, 13),
        suffix=st.lists(st.integers(3, 60), max_size=6),
        identity=st.sampled_from(IDENTITIES),
        max_tokens=st.integers(1, 5),
    )
    def add(self, prefix: int, cut: int, suffix: list[int], identity: str, max_tokens: int):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens)
        prompt = PREFIXES[prefix][:cut] + suffix
        seq = Sequence(GenerateRequest(prompt, sp), self.arrivals, cache_id=identity)
        SequenceGroup([seq])
        self.arrivals += 1
        self.sched.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        """One engine step without a model: every scheduled token computed; a sequence
        whose chunk reaches its end draws a token (and ends at max_tokens)."""
        for seq, n in self.sched.schedule().ordered():
            seq.num_computed += n
            self.sched.prefix.commit(seq)
            if seq.num_computed == seq.num_tokens:
                seq.output_ids.append(3 + len(seq.output_ids) % 5)
                if len(seq.output_ids) >= seq.sampling.max_tokens:
                    self._end(seq, "length")

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 100), running=st.booleans())
    def abort(self, which: int, running: bool):
        pool = [s for s in self.live if (s.status is SeqStatus.RUNNING) == running] or self.live
        self._end(pool[which % len(pool)], "abort")

    @rule(identity=st.sampled_from(IDENTITIES[1:]))
    def unload(self, identity: str):
        self.sched.prefix.forget(identity)

    @rule(n=st.integers(1, 6))
    def take(self, n: int):
        """Blocks taken by someone else (an offline score): evicts cached ones if needed."""
        alloc = self.sched.allocator
        if n <= alloc.num_free:
            self.held.append(alloc.allocate(n))

    @precondition(lambda self: self.held)
    @rule()
    def give_back(self):
        self.sched.allocator.free(self.held.pop())

    def _end(self, seq: Sequence, reason: str) -> None:
        self.sched.finish(seq, reason)
        self.live.remove(seq)

    @invariant()
    def counts_are_exact(self):
        alloc = self.sched.allocator
        alloc.check()  # free xor evictable xor held; keys and owners agree
        tables = [s.blocks for s in self.sched.running + self.sched.waiting] + self.held
        for block in range(NUM_BLOCKS):
            assert alloc.refs(block) == sum(t.count(block) for t in tables), block
        for seq in self.sched.waiting:
            assert not seq.blocks and seq.num_computed == 0

    @invariant()
    def cached_blocks_hold_what_their_key_says(self):
        """A block that is cached and in a table is keyed by that table's tokens there
        (so a hit serves exactly the prefix asked for), and its key leads back to it."""
        alloc, prefix = self.sched.allocator, self.sched.prefix
        for seq in self.sched.running:
            full = seq.num_computed // BS
            keys = prefix.keys(seq, full)
            for block, key in zip(seq.blocks[:full], keys):
                cached = alloc.key_of(block)
                assert cached is None or (cached == key and alloc.lookup(key) == block)

    def teardown(self):
        for seq in list(self.live):
            self._end(seq, "abort")
        for blocks in self.held:
            self.sched.allocator.free(blocks)
        alloc = self.sched.allocator
        alloc.check()
        assert alloc.num_free == NUM_BLOCKS  # nothing leaked


TestBlockBookkeeping = BlockBookkeeping.TestCase
TestBlockBookkeeping.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
