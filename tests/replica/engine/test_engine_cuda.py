"""The engine's CUDA paths against the same oracles as on CPU: transformers + PEFT, the CPU
engine, and a count of device synchronisations per step. Run on a GPU machine; skipped
elsewhere (every CPU path is tested in the other modules)."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
import torch

from replica.engine.engine import LLMEngine
from replica.wire import GenerateRequest, SamplingParams
from tests.conftest import needs_cuda
from tests.engines import make_engine
from tests.oracle import hf_logits, hf_model

pytestmark = needs_cuda
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(assets, device: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 32 << 20)
    kw.setdefault("dtype", "float32")
    return make_engine(assets, {}, device=device, **kw)


def prompt(i: int, n: int = 9) -> list[int]:
    return [(11 * i + 5 * j) % 400 + 3 for j in range(n)]


def drain(eng: LLMEngine, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if not eng.has_work():
            return
        eng.step()
    raise AssertionError("engine did not drain")


def test_mixed_batch_on_cuda_matches_transformers_peft(tiny):
    """fp32 on the GPU, base and every adapter in one batch (Triton kernels): each
    request's greedy tokens are transformers + PEFT's argmax, request by request."""
    names = list(tiny.adapters)
    eng = engine(tiny, "cuda", num_slots=len(names) + 1)
    for name, path in tiny.adapters.items():
        eng.load_adapter(name, path)
    requests = [(prompt(i), GREEDY, ([None] + names)[i % (len(names) + 1)]) for i in range(10)]
    got = eng.generate(requests)
    for (p, _, adapter), seq in zip(requests, got):
        ref = hf_model(tiny.model_dir, tiny.adapters[adapter] if adapter else None)
        # teacher-forced on our tokens: HF's generate cannot pass EOS the way ignore_eos does
        ref_next = hf_logits(ref, p + seq.output_ids)[len(p) - 1 : -1].argmax(-1).tolist()
        assert seq.output_ids == ref_next, adapter


def test_bf16_logits_stay_close_to_the_fp32_oracle(tiny):
    """bf16 (the CUDA default) through the Triton kernels: logits within bf16 rounding of
    transformers + PEFT in fp32."""
    name, path = next(iter(tiny.adapters.items()))
    eng = engine(tiny, "cuda", dtype="auto", num_slots=2)
    assert eng.dtype == torch.bfloat16
    eng.load_adapter(name, path)
    p = prompt(3, 24)
    ours, ref = eng.score(p, name).float().cpu(), hf_logits(hf_model(tiny.model_dir, path), p)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, f"relative logit error {rel:.2e}"


def test_churn_through_the_side_stream_matches_the_cpu_engine(tiny):
    """More adapters than slots, loads on the side stream overlapped with compute (also
    into slots whose batch is running its last step, a replayed graph or an eager prefill
    step): the same tokens as the CPU engine, slot bookkeeping intact after every step."""
    names = list(tiny.adapters)
    adapters = [None if i % 5 == 4 else names[i % len(names)] for i in range(20)]
    requests = [(prompt(i), GREEDY, a) for i, a in enumerate(adapters)]
    gpu = engine(tiny, "cuda", num_slots=3, max_loras_per_batch=2, host_cache_bytes=0)
    assert type(gpu.adapters.loader).__name__ == "SideStreamLoader"
    for name, path in tiny.adapters.items():
        gpu.load_adapter(name, path)
    seqs = [gpu.add_request(GenerateRequest(p, s, a)) for p, s, a in requests]
    for _ in range(3000):
        if not gpu.has_work():
            break
        gpu.step()
        gpu.adapters.pool.check_integrity()
    assert not gpu.has_work()
    cpu = engine(tiny, "cpu", num_slots=len(names) + 1)
    for name, path in tiny.adapters.items():
        cpu.load_adapter(name, path)
    want = [s.output_ids for s in cpu.generate(requests)]
    assert [s.output_ids for s in seqs] == want
    slots = gpu.config.adapters.num_slots
    assert gpu.adapters.prefetcher.loads_started >= len(names) > slots - 1  # churned
    # loads ordered behind a step (its layers, or its graph replay) by CUDA events
    assert gpu.adapters.prefetcher.handovers > 0
    assert gpu.graph_stats()["eager_decode_steps"] == 0  # hand-over steps replay too


@pytest.mark.parametrize("sampling", ["greedy", "temperature", "top-k-top-p"])
def test_a_step_synchronises_once_for_the_sampled_ids(tiny, sampling):
    """Sync-free batch preparation on a real GPU: with CUDA's sync debug mode on, each step
    that runs a batch makes exactly one synchronising call (reading the sampled ids)."""
    names = list(tiny.adapters)
    eng = engine(tiny, "cuda", num_slots=len(names) + 1)
    for name, path in tiny.adapters.items():
        eng.load_adapter(name, path)
    params = {
        "greedy": GREEDY,
        "temperature": SamplingParams(max_tokens=12, temperature=0.8, seed=7),
        "top-k-top-p": SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=7),
    }[sampling]
    for i in range(8):
        eng.add_request(GenerateRequest(prompt(i), params, ([None] + names)[i % (len(names) + 1)]))
    eng.step()  # first prefill: lazy CUDA/Triton initialisation stays out of the count
    counts, where = [], set()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(200):
            if not eng.has_work():
                break
            steps = eng.telemetry.stats.steps
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng.step()
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            where |= {f"{w.filename}:{w.lineno}" for w in syncs}
            if eng.telemetry.stats.steps > steps:
                counts.append(len(syncs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts and set(counts) == {1}, (counts, sorted(where))


def test_decode_graphs_are_captured_for_every_bucket(tiny):
    eng = engine(tiny, "cuda", max_num_seqs=16)
    static = eng.executor.static_decode
    assert static is not None and static.buckets == [1, 2, 4, 8, 16]
    assert static.num_graphs == 2 * len(static.buckets)  # with and without LoRA
    assert eng.graph_stats() == {
        "graphs_captured": 10, "graph_replays": 0, "eager_decode_steps": 0,
    }  # fmt: skip
    assert static.logits.shape == (16, eng.spec.vocab_size)  # one buffer for every graph


def test_graph_replay_equals_eager_across_adapter_loads(tiny):
    """More adapters than slots, so adapters load and slots activate between replays (and
    slots are handed over during replayed steps): the tokens of CUDA-graph decode equal
    those of eager decode on the same GPU, and the counters say which path ran."""
    names = list(tiny.adapters)
    adapters = [None if i % 4 == 3 else names[i % len(names)] for i in range(14)]
    requests = [(prompt(i, 5 + i % 7), GREEDY, a) for i, a in enumerate(adapters)]
    results = []
    for graphs in (True, False):
        eng = engine(tiny, "cuda", num_slots=3, max_loras_per_batch=2, cuda_graphs=graphs)
        for name, path in tiny.adapters.items():
            eng.load_adapter(name, path)
        results.append([s.output_ids for s in eng.generate(requests)])
        stats = eng.graph_stats()
        if graphs:
            assert stats["graph_replays"] > 0 and stats["eager_decode_steps"] == 0, stats
        else:
            assert stats["graph_replays"] == 0 and stats["eager_decode_steps"] > 0, stats
    assert results[0] == results[1]


def test_out_of_memory_in_capture_leaves_decode_eager_and_the_engine_serving(tiny, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(torch.cuda, "graph", no_memory)
    eng = engine(tiny, "cuda")
    assert eng.graph_stats()["graphs_captured"] == 0
    want = engine(tiny, "cuda", cuda_graphs=False).generate([(prompt(1), GREEDY, None)])
    got = eng.generate([(prompt(1), GREEDY, None)])
    assert got[0].output_ids == want[0].output_ids
    assert eng.graph_stats()["eager_decode_steps"] > 0


def test_any_other_capture_failure_fails_the_start(tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(torch.cuda, "graph", broken)
    with pytest.raises(RuntimeError, match="CUDA graph capture of decode bucket"):
        engine(tiny, "cuda")


def test_nothing_compiles_while_serving(tiny):
    """Every Triton kernel variant a varied workload launches was compiled at start."""
    from tests.replica.executor.steps import triton_kernels

    jitted = triton_kernels()

    def compiled() -> int:
        return sum(len(cache[0]) for k in jitted for cache in k.device_caches.values())

    names = [None, *tiny.adapters]
    eng = engine(tiny, "cuda", num_slots=len(names), max_num_seqs=24, block_size=4)
    for name, path in tiny.adapters.items():
        eng.load_adapter(name, path)
    at_start = compiled()
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    for i, n in enumerate([1, 2, 3, 9, 17, 40, 70, *range(4, 22)]):
        eng.add_request(GenerateRequest(prompt(i, n), sp, names[i % len(names)]))
        if i % 3 == 0:
            eng.step()
    drain(eng)
    eng.score(prompt(2, 30), names[1])
    assert compiled() == at_start


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_cuda_1_works_there_alone(tiny):
    """device cuda:1: graphs, Triton kernels, side-stream loads and the async loop all run
    on GPU 1 (nothing is allocated on GPU 0), with cuda:0's tokens."""
    from replica.serve.async_engine import AsyncLLMEngine

    names = list(tiny.adapters)
    requests = [(prompt(i), GREEDY, ([None] + names)[i % (len(names) + 1)]) for i in range(6)]
    first = engine(tiny, "cuda:0", num_slots=len(names) + 1)
    for name, path in tiny.adapters.items():
        first.load_adapter(name, path)
    want = [s.output_ids for s in first.generate(requests)]
    first.shutdown()
    del first
    gc.collect()
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    second = engine(tiny, "cuda:1", num_slots=len(names) + 1)
    for name, path in tiny.adapters.items():
        second.load_adapter(name, path)
    assert [s.output_ids for s in second.generate(requests)] == want
    loop = AsyncLLMEngine(second)  # its thread starts on GPU 0 unless it sets GPU 1

    async def served() -> list[list[int]]:
        streams = [loop.add_request(GenerateRequest(*request)) for request in requests]
        outputs = []
        for stream in streams:
            tokens = []
            while (replies := await stream.next()) is not None:
                tokens += [t for reply in replies for t in reply.token_ids]
            outputs.append(tokens)
        return outputs

    try:
        assert asyncio.run(asyncio.wait_for(served(), 120)) == want
    finally:
        loop.shutdown()
    assert torch.cuda.memory_allocated(0) <= before  # GPU 0 got nothing new
