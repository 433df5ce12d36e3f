"""Fair share (engine/fair_share.py) with plain data: VTC's counters, order, idle lift and
weights; skip-not-block through the real scheduler; and a property test that two
backlogged tenants' weighted service never drifts apart by more than VTC's 2U bound
(FCFS, on the same simulation, does)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.adapters.slot_pool import AdapterSlotPool
from replica.adapters.slot_pool import make_policy as make_eviction
from replica.engine.fair_share import VTC, W_IN, W_OUT, make_policy
from replica.engine.kv_blocks import BlockAllocator
from replica.engine.scheduler import FCFS, AdmissionPolicy, Scheduler
from replica.engine.sequence import SeqStatus, Sequence
from replica.wire import GenerateRequest, SamplingParams

_ids = itertools.count()


def seq(tenant: str | None, prompt: int = 4, max_tokens: int = 2, adapter: str | None = None):
    arrival = next(_ids)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = GenerateRequest([5] * prompt, sampling, adapter, f"r{arrival}", tenant=tenant)
    return Sequence(request, arrival, adapter)


def add(policy: AdmissionPolicy, waiting: list[Sequence], s: Sequence, weight: float = 1.0):
    policy.arrived(s, weight, waiting, [])
    waiting.append(s)
    return s


def test_counters_charge_uncached_prompt_and_output_tokens_over_the_weight():
    vtc, waiting = VTC(), []
    a = add(vtc, waiting, seq("a"))
    b = add(vtc, waiting, seq("b"), weight=2.0)
    vtc.admitted(a, 10)
    vtc.admitted(b, 10)
    for _ in range(3):
        vtc.generated(a)
        vtc.generated(b)
    assert vtc.counters() == {"a": W_IN * 10 + 3 * W_OUT, "b": (W_IN * 10 + 3 * W_OUT) / 2}


def test_the_lowest_counter_goes_first_and_the_order_follows_each_admission():
    vtc, waiting = VTC(), []
    for _ in range(3):
        add(vtc, waiting, seq("a"))
    bs = [add(vtc, waiting, seq("b")) for _ in range(2)]
    order = []
    for s in vtc.candidates(waiting):  # every candidate admitted: each charges 4
        order.append(s.tenant)
        vtc.admitted(s, 4)
    assert order == ["a", "b", "a", "b", "a"]  # ties go to the oldest head
    vtc2, waiting2 = VTC(), []
    add(vtc2, waiting2, seq("a"))
    vtc2.admitted(waiting2.pop(), 100)  # a served a lot, still running, nothing waiting
    add(vtc2, waiting2, seq("a"))
    waiting2 += bs  # b arrives after a, and a's counter is higher
    assert [s.tenant for s in vtc2.candidates(waiting2)][0] == "b"


def test_on_a_tie_the_tenant_with_fewer_requests_running_goes_first():
    vtc, waiting = VTC(), []
    a_old = add(vtc, waiting, seq("a"))
    b_new = add(vtc, waiting, seq("b"))  # lifted to a's counter: a tie
    running = [seq("a"), seq("a")]  # a is being served already
    assert next(vtc.candidates(waiting, running)) is b_new
    assert next(vtc.candidates(waiting)) is a_old  # nobody running: the oldest request


def test_a_tenant_back_from_idle_is_lifted_to_the_lowest_waiting_counter():
    vtc, waiting = VTC(), []
    a, b = add(vtc, waiting, seq("a")), add(vtc, waiting, seq("b"))
    vtc.admitted(a, 50)
    vtc.admitted(b, 20)
    waiting.clear()  # both admitted; a floods again, b goes idle
    add(vtc, waiting, seq("a"))
    vtc.admitted(waiting.pop(), 30)  # a: 80
    add(vtc, waiting, seq("a"))
    add(vtc, waiting, seq("c"))  # a newcomer starts at the lowest waiting counter, 80
    add(vtc, waiting, seq("b"))  # b (20) banks nothing from its idle time: lifted to 80
    assert vtc.counters() == {"a": 80, "b": 80, "c": 80}
    add(vtc, waiting, seq("b"))  # b has a request waiting: not lifted again
    vtc.admitted(waiting[-1], 5)
    add(vtc, waiting, seq("b"))
    assert vtc.counters()["b"] == 85


def test_with_nothing_waiting_a_newcomer_starts_level_with_those_running():
    vtc, waiting, running = VTC(), [], []
    a = add(vtc, waiting, seq("a"))
    vtc.admitted(a, 40)
    running.append(waiting.pop())
    b = seq("b")
    vtc.arrived(b, 1.0, waiting, running)
    assert vtc.counters()["b"] == 40
    idle = VTC()  # nobody active: the newcomer starts at the highest counter of all
    x = add(idle, [], seq("x"))
    idle.admitted(x, 7)
    add(idle, [], seq("y"))
    assert idle.counters()["y"] == 7


def test_weights_split_admissions_two_to_one():
    vtc, waiting = VTC(), []
    for _ in range(30):
        add(vtc, waiting, seq("heavy"), weight=2.0)
        add(vtc, waiting, seq("light"), weight=1.0)
    order = []
    for s in vtc.candidates(waiting):
        if len(order) == 30:
            break
        order.append(s.tenant)
        vtc.admitted(s, 4)
    assert order.count("heavy") == 20 and order.count("light") == 10


def test_fcfs_is_arrival_order_and_keeps_no_counters():
    fcfs, waiting = FCFS(), []
    seqs = [add(fcfs, waiting, seq(t)) for t in "abba"]
    for s in seqs:
        fcfs.admitted(s, 10)
    assert list(fcfs.candidates(waiting)) == seqs
    assert fcfs.counters() == {} and fcfs.lags(waiting, []) == {}
    assert isinstance(make_policy(None), FCFS) and isinstance(make_policy("vtc"), VTC)
    with pytest.raises(ValueError, match="unknown scheduling"):
        make_policy("lottery")


def test_lags_say_how_far_each_tenant_is_above_the_next_served():
    vtc, waiting = VTC(), []
    a = add(vtc, waiting, seq("a"))
    add(vtc, waiting, seq("b"))
    vtc.admitted(a, 30)
    assert vtc.lags(waiting, []) == {"a": 30}  # b is served next: it lags 0, left out


# -- through the real scheduler (host-only) ----------------------------------------------------


def scheduler(policy: AdmissionPolicy, max_num_seqs: int = 8, num_blocks: int = 256, **kw):
    pool = AdapterSlotPool(3, make_eviction("lru"))
    return Scheduler(
        BlockAllocator(num_blocks), pool, block_size=4, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=kw.pop("tokens", 512), max_loras_per_batch=kw.pop("loras", 2),
        aging_steps=kw.pop("aging", 1000), policy=policy,
    )  # fmt: skip


def test_a_tenant_whose_adapter_is_not_ready_does_not_block_the_others():
    sched = scheduler(VTC())
    ready = sched.pool.reserve("ready", {"lora": 64})
    sched.pool.mark_ready(ready)
    waiting_on_load = [seq("b", adapter="loading") for _ in range(2)]  # b: lowest counter
    for s in waiting_on_load:
        sched.add(s)
    others = [seq("a", adapter="ready"), seq("c")]  # c on the base model
    for s in others:
        sched.add(s)
    batch = sched.schedule()
    assert set(batch.seqs) == set(others)
    assert all(s.status is SeqStatus.WAITING and s.skips == 1 for s in waiting_on_load)
    assert sched.policy.counters()["b"] == 0  # skipped: not charged, still first in line


# -- the bound ------------------------------------------------------------------------------------


def simulate(policy: AdmissionPolicy, requests: dict[str, list[tuple[int, int]]],
             weights: dict[str, float], seats: int, steps: int = 80,
             flood: int = 0) -> list[float]:  # fmt: skip
    """Tenants a and b kept backlogged (more waiting than a step can admit) on the real
    scheduler, a token drawn per sampled sequence as the engine draws them, after `flood`
    of a's requests were queued before any of b's. Returns, after every step, a's weighted
    service minus b's, each (W_IN * prompt + W_OUT * output tokens) / weight."""
    sched = scheduler(policy, max_num_seqs=seats, num_blocks=10_000, tokens=64)
    cursor = dict.fromkeys(requests, 0)
    service = dict.fromkeys(requests, 0.0)

    def arrive(t: str) -> None:
        prompt, out = requests[t][cursor[t] % len(requests[t])]
        cursor[t] += 1
        sched.add(seq(t, prompt, out), weights[t])

    for _ in range(flood):
        arrive("a")
    diffs = [0.0]
    for _ in range(steps):
        for t in requests:
            while sum(s.tenant == t for s in sched.waiting) <= seats:
                arrive(t)
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new):
            if s.num_computed == 0 and not s.output_ids:  # first admission: its prompt
                service[s.tenant] += W_IN * len(s.prompt_ids) / weights[s.tenant]
            s.num_computed += n
            if s.num_computed == s.num_tokens:  # sampled: one token drawn
                s.output_ids.append(5)
                policy.generated(s)
                service[s.tenant] += W_OUT / weights[s.tenant]
                if len(s.output_ids) >= s.sampling.max_tokens:
                    sched.finish(s, "length")
        diffs.append(service["a"] - service["b"])
    return diffs


def vtc_bound(requests, weights, seats: int) -> float:
    """2U: each tenant's U = (W_IN * longest prompt + W_OUT * seats * longest output) / weight."""
    return sum(
        (W_IN * max(p for p, _ in sizes) + W_OUT * seats * max(o for _, o in sizes)) / weights[t]
        for t, sizes in requests.items()
    )


sizes = st.lists(st.tuples(st.integers(1, 24), st.integers(1, 8)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    a=sizes,
    b=sizes,
    weight_a=st.sampled_from([1.0, 2.0, 3.0, 0.5]),
    weight_b=st.sampled_from([1.0, 2.0, 0.5]),
    seats=st.integers(1, 4),
    flood=st.integers(0, 20),
)
def test_two_backlogged_tenants_stay_within_the_vtc_bound(a, b, weight_a, weight_b, seats, flood):
    requests, weights = {"a": a, "b": b}, {"a": weight_a, "b": weight_b}
    diffs = simulate(VTC(), requests, weights, seats, flood=flood)
    # over any interval [t1, t2] of the backlog the difference is diffs[t2] - diffs[t1]
    assert max(diffs) - min(diffs) <= vtc_bound(requests, weights, seats) + 1e-9


def test_fcfs_breaks_the_bound_when_one_tenant_floods_first():
    """The same measure fails under FCFS: b's requests queue behind a's flood."""
    requests, weights = {"a": [(8, 4)], "b": [(8, 4)]}, {"a": 1.0, "b": 1.0}
    fcfs = simulate(FCFS(), requests, weights, seats=1, flood=60)
    assert max(fcfs) - min(fcfs) > 5 * vtc_bound(requests, weights, 1)
    vtc = simulate(VTC(), requests, weights, seats=1, flood=60)
    assert max(vtc) - min(vtc) <= vtc_bound(requests, weights, 1)
