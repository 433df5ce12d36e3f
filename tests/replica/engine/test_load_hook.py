"""LLMEngine.set_load_hook: called once per adapter load, with its weights, where the load
runs (inside the step with sync loading, on the loader thread with overlap); None removes it."""

from __future__ import annotations

import threading
import time

import pytest

from replica.engine.engine import LLMEngine
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _engine(tiny, loading: str) -> LLMEngine:
    # the adapters are staged in host memory: no slot, no load yet
    return make_engine(tiny, num_slots=5, max_loras_per_batch=4, max_num_seqs=4,
                       kv_cache_bytes=1 << 20, adapter_loading=loading)  # fmt: skip


def _serve(eng: LLMEngine, adapters: list[str]) -> None:
    for i, adapter in enumerate(adapters):
        eng.add_request(GenerateRequest([5 + i, 9, 13], GREEDY, adapter))
    for _ in range(10_000):
        if not eng.has_work():
            return
        eng.step()
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("loading", ["sync", "overlap"])
def test_the_hook_runs_once_per_load_where_the_load_runs(tiny, loading):
    eng = _engine(tiny, loading)
    names = list(tiny.adapters)[:2]
    calls: list[tuple[str, int, bool]] = []

    def hook(weights) -> None:
        calls.append((weights.name, weights.rank, threading.current_thread() is main))
        time.sleep(0.05)

    main = threading.current_thread()
    try:
        assert not calls
        eng.set_load_hook(hook)
        _serve(eng, names)
        assert sorted(name for name, _, _ in calls) == sorted(names)  # each loaded once
        assert all(rank > 0 for _, rank, _ in calls)
        # sync loading copies inside the step: the hook's sleep is step time blocked on loads
        assert all(on_main == (loading == "sync") for _, _, on_main in calls)
        if loading == "sync":
            assert eng.load_wait_seconds >= 2 * 0.05
        eng.set_load_hook(None)
        _serve(eng, list(tiny.adapters)[2:])  # two more loads, no hook
        assert len(calls) == 2
    finally:
        eng.shutdown()
