"""Engine behaviour with adapters: churn, skip-not-block, prefetch, abort, aging, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from replica.adapters.slot_pool import SlotState
from replica.adapters.sources import PeftDirectorySource
from replica.engine.engine import LLMEngine
from replica.engine.scheduler import plan_step
from replica.engine.sequence import SeqStatus, Sequence
from replica.executor.batch import build_batch
from replica.model.lora_slots import SlotTable
from replica.model.spec import load_model_spec
from replica.wire import GenerateRequest, SamplingParams
from tests.conftest import tiny_assets
from tests.engines import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class SlowSource(PeftDirectorySource):
    """A PEFT source whose reads take `delay` seconds (a slow disk or object store)."""

    def __init__(self, assets, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        spec = load_model_spec(assets.model_dir)
        super().__init__(spec, 64, {n: p for n, p in assets.adapters.items()})
        self.delay, self.gate, self.fetched = delay, gate, []

    def fetch(self, name):
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        time.sleep(self.delay)
        self.fetched.append(name)
        return super().fetch(name)


def engine(assets, source=None, **kw) -> LLMEngine:
    kw.setdefault("num_slots", 3)
    return make_engine(assets, {}, source=source or SlowSource(assets), **kw)


def prompt(i: int, n: int = 8) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 3 for j in range(n)]


def run(eng: LLMEngine, max_steps: int = 2000, check=None) -> None:
    for _ in range(max_steps):
        if not eng.has_work():
            return
        eng.step()
        if check:
            check()
    raise AssertionError("engine did not drain")


def test_churn_never_evicts_base_or_overwrites_a_referenced_slot(tiny):
    """More adapters than fit (ranks 8 + 16 + 32 share the one rank-64 block adapter-03
    needs alone): after every step, each running sequence's adapter rows hold exactly its
    adapter's weights, and slot 0 has rank 0."""
    eng = engine(tiny, num_slots=2, max_loras_per_batch=2, host_cache_bytes=0)
    names = list(tiny.adapters)
    reference = {n: eng.adapters.source.fetch(n) for n in names}
    seqs = [
        eng.add_request(
            GenerateRequest(prompt(i), GREEDY, None if i % 5 == 4 else names[i % len(names)])
        )
        for i in range(20)
    ]

    def check() -> None:
        eng.adapters.pool.check_integrity()
        table = eng.executor.lora.table
        assert all(ranks[0] == 0 for ranks in table.ranks.values()), "slot 0 has a rank"
        for slot in eng.adapters.pool.slots[1:]:  # the table points at the pool's rows
            if slot.state.value == "ready":
                for group, row0 in slot.offsets.items():
                    assert table.offsets[group][slot.index] == row0
        for seq in eng.scheduler.running:
            if seq.request.adapter is None:
                assert seq.slot == 0
                continue
            slot = eng.adapters.pool.slots[seq.slot]
            assert slot.adapter == seq.request.adapter
            a, b = reference[seq.request.adapter].weights[(0, "q_proj")]
            row0 = slot.offsets["qkv_proj"]
            rows = slice(row0, row0 + a.shape[0])
            buf = eng.executor.lora.layers[0]["qkv_proj"]
            assert torch.equal(buf.a[0, rows], a), f"slot {seq.slot}'s rows overwritten"
            assert torch.equal(buf.b[: b.shape[0], rows], b)

    run(eng, check=check)
    assert eng.adapters.pool.num_evictions > 0, "the test should force evictions"
    assert all(s.finish_reason == "length" for s in seqs)
    alone = engine(tiny, num_slots=6)
    for s in seqs:
        assert (
            s.output_ids
            == alone.generate([(s.prompt_ids, GREEDY, s.request.adapter)])[0].output_ids
        )


def test_base_request_behind_loading_adapters_is_served_first(tiny):
    gate = threading.Event()
    eng = engine(tiny, SlowSource(tiny, gate=gate), num_slots=5, host_cache_bytes=0)
    adapter_seqs = [
        eng.add_request(GenerateRequest(prompt(i), GREEDY, n)) for i, n in enumerate(tiny.adapters)
    ]
    base = eng.add_request(GenerateRequest(prompt(9), GREEDY, None))
    for _ in range(GREEDY.max_tokens):
        eng.step()
    assert base.status is SeqStatus.FINISHED, "base request must not wait on adapter I/O"
    assert all(not s.output_ids for s in adapter_seqs)
    assert all(eng.adapters.pool.state(n) is SlotState.LOADING for n in list(tiny.adapters)[:2])
    gate.set()
    run(eng)
    assert all(s.finish_reason == "length" for s in adapter_seqs)
    assert eng.load_wait_seconds > 0


def test_prefetch_starts_before_the_request_reaches_the_head(tiny):
    eng = engine(tiny, max_num_seqs=1)
    heads = [eng.add_request(GenerateRequest(prompt(i), GREEDY, None)) for i in range(3)]
    tail = eng.add_request(GenerateRequest(prompt(5), GREEDY, "adapter-01"))
    eng.step()
    assert eng.scheduler.waiting[0] is heads[1]  # the adapter request is third in line
    assert eng.adapters.pool.state("adapter-01") in (SlotState.LOADING, SlotState.READY)
    run(eng)
    assert tail.finish_reason == "length"


def test_abort_frees_kv_blocks_and_slot_references(tiny):
    eng = engine(tiny)
    free_blocks = eng.scheduler.allocator.num_free
    seq = eng.add_request(
        GenerateRequest(prompt(1, 40), SamplingParams(temperature=0, max_tokens=50), "adapter-02")
    )
    for _ in range(200):
        eng.step()
        if seq.status is SeqStatus.RUNNING and seq.output_ids:
            break
    slot = seq.slot
    assert eng.adapters.pool.slots[slot].refs == 1
    eng.abort(seq)
    assert seq.finish_reason == "abort"
    assert eng.scheduler.allocator.num_free == free_blocks
    assert eng.adapters.pool.slots[slot].refs == 0
    assert not eng.has_work()
    eng.adapters.pool.check_integrity()


def test_aging_lets_a_skipped_adapter_run_despite_a_stream_of_others(tiny):
    eng = engine(tiny, max_loras_per_batch=1, aging_steps=4, num_slots=3)
    eng.add_request(GenerateRequest(prompt(0), GREEDY, "adapter-00"))
    for _ in range(3):
        eng.step()
    starved = eng.add_request(GenerateRequest(prompt(1), GREEDY, "adapter-01"))
    for i in range(200):  # adapter-00 traffic never stops arriving
        eng.add_request(GenerateRequest(prompt(i + 2), GREEDY, "adapter-00"))
        eng.step()
        if starved.status is SeqStatus.FINISHED:
            break
    assert starved.finish_reason == "length", "aging must end the starvation"
    assert starved.skips >= 4


def test_failed_adapter_load_ends_its_requests_with_an_error(tiny):
    class Broken(SlowSource):
        def fetch(self, name):
            if name == "adapter-03":
                raise OSError("disk on fire")
            return super().fetch(name)

    eng = engine(tiny, Broken(tiny))
    bad = eng.add_request(GenerateRequest(prompt(1), GREEDY, "adapter-03"))
    good = eng.add_request(GenerateRequest(prompt(2), GREEDY, "adapter-00"))
    run(eng)
    assert bad.finish_reason == "error" and "disk on fire" in str(bad.group.error)
    assert good.finish_reason == "length"
    eng.adapters.pool.check_integrity()


def test_base_slot_unpinned_ablation_still_correct(tiny):
    eng = engine(tiny, pin_base_slot=False, num_slots=3)
    names = [None, "adapter-00", "adapter-01"]
    seqs = [eng.add_request(GenerateRequest(prompt(i), GREEDY, names[i % 3])) for i in range(6)]
    run(eng)
    ref = engine(tiny, num_slots=4)
    for s in seqs:
        assert (
            s.output_ids == ref.generate([(s.prompt_ids, GREEDY, s.request.adapter)])[0].output_ids
        )
    assert eng.adapters.prefetcher.loads_started >= 3  # the base had to be "loaded" like an adapter


def test_a_batch_ending_at_once_hands_its_slots_to_the_next_adapters(tiny):
    """Every request has the same length, so a whole batch ends in one step. The slots it
    frees start loading the waiting requests' adapters during that last step, layer by
    layer behind the forward; the tokens stay each request's solo tokens. Adapters of
    rank 64 in two rank-64 blocks: each batch's blocks are what the next batch needs (a
    hand-over keeps them whole while that step runs, then trims them to the new ranks)."""
    many = tiny_assets("llama", num_adapters=16)
    source = SlowSource(many)
    names = [n for n in many.adapters if max(source.ranks(n).values()) == 64]
    eng = engine(many, source, num_slots=3, max_loras_per_batch=2)
    seqs = [
        eng.add_request(GenerateRequest(prompt(i), GREEDY, names[i % len(names)])) for i in range(8)
    ]
    run(eng, check=eng.adapters.pool.check_integrity)
    assert eng.adapters.prefetcher.handovers >= 2
    alone = engine(many, num_slots=6)
    for s in seqs:
        assert (
            s.output_ids
            == alone.generate([(s.prompt_ids, GREEDY, s.request.adapter)])[0].output_ids
        )


@pytest.mark.parametrize("loading", ["overlap", "sync"])
def test_loading_modes_agree(tiny, loading):
    eng = engine(tiny, adapter_loading=loading, num_slots=3)
    seqs = [
        eng.add_request(GenerateRequest(prompt(i), GREEDY, list(tiny.adapters)[i % 4]))
        for i in range(8)
    ]
    run(eng)
    ref = engine(tiny, num_slots=5)
    for s in seqs:
        assert (
            s.output_ids == ref.generate([(s.prompt_ids, GREEDY, s.request.adapter)])[0].output_ids
        )


def test_batch_preparation_reads_no_device_value(tiny):
    """Batch preparation against `meta` tensors, where any read of a device value raises."""
    with pytest.raises(NotImplementedError, match="meta tensor"):
        torch.zeros(2, device="meta").tolist()
    seqs = []
    for i, (n_computed, n_tokens) in enumerate([(9, 10), (0, 7), (4, 12)]):
        s = Sequence(GenerateRequest(list(range(3, 3 + n_tokens)), GREEDY), i, slot=i % 2)
        s.num_computed, s.blocks = n_computed, [i * 4 + b for b in range(4)]
        seqs.append(s)
    work = [(seqs[0], 1), (seqs[1], 7), (seqs[2], 5)]
    slots = SlotTable(
        {"qkv_proj": [0, 16], "down_proj": [0, 0]},
        [0.0, 2.0],
        {"qkv_proj": [0, 8], "down_proj": [0, 0]},
    )
    plan, sampled, _ = plan_step(work, 4)
    batch, rows = build_batch(plan, 4, slots, torch.device("meta"))
    assert batch.input_ids.device.type == "meta" and rows.device.type == "meta"
    qkv, down = batch.lora["qkv_proj"], batch.lora["down_proj"]
    assert qkv.seg_slots.device.type == "meta" and qkv.slot_ranks.device.type == "meta"
    assert qkv.slot_offsets.device.type == "meta"
    assert batch.attn.num_decode == 1 and qkv.has_lora and not down.has_lora
    assert qkv.max_seg_len == 7 and sampled == seqs[:2]


def test_more_waiting_requests_than_the_window_do_not_livelock(tiny):
    """Regression: with every slot READY, unreferenced and wanted by someone in the
    window, the oldest request's adapter must still be able to evict (it used not to:
    every slot was protected and aging held the resident adapters back)."""
    eng = engine(tiny, num_slots=3, max_loras_per_batch=2, prefetch_window=16, aging_steps=2)
    names = list(tiny.adapters)
    seqs = [eng.add_request(GenerateRequest(prompt(i), GREEDY, names[i % 4])) for i in range(24)]
    run(eng, max_steps=3000)
    assert all(s.finish_reason == "length" for s in seqs)


def test_telemetry_counts_lookups_useful_loads_and_load_latencies(tiny):
    eng = engine(tiny, num_slots=2)  # one rank-64 block: adapter-03 fills it alone
    c, b, a = list(tiny.adapters)[1:]
    for i, name in enumerate([a, a, b, a]):  # miss, device, miss (evicts a), host
        eng.add_request(GenerateRequest(prompt(i), GREEDY, name))
        run(eng)
    wasted = eng.add_request(GenerateRequest(prompt(9), GREEDY, c))  # loaded, aborted unrun
    eng.step()
    assert eng.adapters.prefetcher.is_loading(c)
    eng.abort(wasted)
    for _ in range(2000):  # bounded: the load lands in milliseconds
        if not eng.adapters.prefetcher.num_inflight:
            break
        eng.adapters.prefetcher.wait_any(0.01)
        eng.step()
    t = eng.drain_telemetry()
    assert t["lookups"] == {"device": 1, "host": 1, "miss": 3}
    assert t["loads_started"] == t["loads_done"] == 4
    assert t["loads_used"] == 3  # c's load served no request
    assert len(t["load_latencies_s"]) == 4 and all(s > 0 for s in t["load_latencies_s"])
    assert t["slots"] == {"free": 0, "loading": 0, "ready": 1}
    assert t["steps"] > 0 and t["preemptions"] == 0
    assert eng.drain_telemetry()["load_latencies_s"] == []  # drained once
    eng.shutdown()


def test_unload_lets_queued_and_running_requests_finish_and_refuses_new_ones(tiny):
    """One request runs on adapter-01, one waits for a slot (the single adapter slot is
    busy), both on the adapter being unloaded: both finish with their solo outputs, and
    only then do its weights leave (source, host cache, slot)."""
    a, b = list(tiny.adapters)[:2]
    solo = engine(tiny, num_slots=3).generate([(prompt(1), GREEDY, b), (prompt(2), GREEDY, b)])
    eng = engine(tiny, num_slots=2, max_loras_per_batch=1, host_cache_bytes=0)
    first = eng.add_request(GenerateRequest(prompt(0), GREEDY, a))
    running = eng.add_request(GenerateRequest(prompt(1), GREEDY, b))
    queued = eng.add_request(GenerateRequest(prompt(2), GREEDY, b))
    for _ in range(200):  # until b runs
        eng.step()
        if running.status is SeqStatus.RUNNING:
            break
    # a's slot is wanted again: b's must hold
    eng.add_request(GenerateRequest(prompt(3), GREEDY, a))
    eng.unload_adapter(b)
    with pytest.raises(Exception, match="unknown adapter"):
        eng.add_request(GenerateRequest(prompt(4), GREEDY, b))
    assert b in eng.adapters.source.names()  # still needed
    run(eng)
    assert [running.output_ids, queued.output_ids] == [s.output_ids for s in solo]
    assert first.finish_reason == running.finish_reason == queued.finish_reason == "length"
    assert b not in eng.adapters.source.names() and b not in eng.adapters.host_cache.names()
    assert eng.adapters.pool.state(b) is None


def test_registering_a_known_name_again_is_refused_and_unload_then_load_takes_the_new_weights(
    tiny,
):
    """A name registered again would keep serving the weights resident in its slot, so it
    is refused; unloaded first, the name serves the new directory's weights."""
    a, b = list(tiny.adapters)[:2]
    solo_b = engine(tiny).generate([(prompt(1), GREEDY, b)])[0].output_ids
    eng = engine(tiny, source=PeftDirectorySource(load_model_spec(tiny.model_dir), 64, {}))
    eng.load_adapter("x", tiny.adapters[a])
    on_a = eng.generate([(prompt(1), GREEDY, "x")])[0].output_ids  # x resident in a slot
    with pytest.raises(Exception, match="already registered"):
        eng.load_adapter("x", tiny.adapters[b])
    assert eng.generate([(prompt(1), GREEDY, "x")])[0].output_ids == on_a
    eng.unload_adapter("x")
    eng.load_adapter("x", tiny.adapters[b])
    assert eng.generate([(prompt(1), GREEDY, "x")])[0].output_ids == solo_b != on_a
