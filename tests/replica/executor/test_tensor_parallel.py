"""Tensor parallelism on CPU (gloo, 2 ranks): a TP=2 engine gives what a TP=1 engine gives.

The oracle is TP=1, itself checked against transformers + PEFT (test_model_vs_hf.py).
Rank 0 is this process, rank 1 a Ray actor. A process holds one tensor-parallel rank at
a time, so every test (or class) builds its own TP=2 engine and shuts it down.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import ray

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.errors import RequestError
from replica.executor.tp_group import TPRankError
from replica.model.adapter_weights import load_peft_adapter
from replica.model.tp_shard import TPShard
from replica.wire import GenerateRequest, SamplingParams
from tests.conftest import tiny_assets
from tests.engines import make_engine
from tests.fakes import FakeGraphs
from tests.tp_checks import GREEDY, LOGIT_ATOL, check_tp2_equals_tp1, prompts, staggered

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def engine(assets, tp_size: int = 1, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 32 << 20)
    return make_engine(assets, tp_size=tp_size, **kw)


def mixed(assets, vocab: int) -> list[tuple[list[int], SamplingParams, str | None]]:
    names = [None, *assets.adapters, None, list(assets.adapters)[1]]
    lengths = [3, 17, 9, 30, 1, 12, 25, 6, 14, 8, 21][: len(names)]
    ps = prompts(vocab, lengths)
    return [(p, GREEDY, a) for p, a in zip(ps, names)]


def peft_rank(path) -> int:
    return json.loads((path / "adapter_config.json").read_text())["r"]


def worker(eng: LLMEngine):
    [w] = eng.executor.group.workers
    return w


def expected_shard(eng: LLMEngine, adapter: str, rank: int):
    path = eng.adapters.source.locate(adapter).path
    whole = load_peft_adapter(path, eng.spec, eng.config.max_lora_rank, adapter)
    return whole, whole.select(TPShard(eng.spec, rank, 2).slice_lora)


def check_rank1_slots(eng: LLMEngine) -> None:
    """Every READY adapter slot holds, on rank 1, rank 1's shard of rank 0's adapter there."""
    for slot in eng.adapters.pool.slots[1:]:
        if slot.state.value != "ready":
            continue
        _, shard = expected_shard(eng, slot.adapter, 1)
        r = shard.rank
        want = shard.weights.get((0, "o_proj"))
        if want is None:
            continue
        row0 = slot.offsets["o_proj"]
        a, b = ray.get(worker(eng).slot_weights.remote(0, "o_proj", row0, r))
        assert np.array_equal(a[0], want[0].numpy()), f"slot {slot.index} A on rank 1"
        assert np.array_equal(b, want[1].numpy()), f"slot {slot.index} B on rank 1"


@pytest.fixture(scope="class")
def engines(demo):
    """TP=1 and TP=2 engines of the demo model with its 8 adapters, for one class."""
    one, two = engine(demo), engine(demo, tp_size=2)
    yield one, two
    two.shutdown()
    one.shutdown()


class TestDemoModel:
    """The demo model (hidden 512, 8 layers, 8 heads / 2 KV heads) and its 8 adapters."""

    @pytest.mark.parametrize("index", range(9))
    def test_logits_equal_tp1(self, demo, engines, index):
        one, two = engines
        adapter = [None, *demo.adapters][index]
        for p in prompts(one.spec.vocab_size):
            diff = (two.score(p, adapter) - one.score(p, adapter)).abs().max().item()
            assert diff < LOGIT_ATOL, f"{adapter}: max |TP2 - TP1 logit| {diff}"

    def test_greedy_mixed_batch_equals_tp1(self, demo, engines):
        one, two = engines
        reqs = mixed(demo, one.spec.vocab_size)
        out = staggered(two, reqs)
        assert out == staggered(one, reqs)
        assert len({tuple(o) for o in out}) > 6, "adapters should give distinct outputs"

    def test_forked_choices_read_kv_copied_on_every_rank(self, demo, engines):
        """n greedy choices: choices 1..n-1 decode from KV blocks copied from choice 0's
        prefill, on rank 1 with the next step's message; a rank missing its copy would
        decode other tokens."""
        one, two = engines
        adapter = next(iter(demo.adapters))
        prompt = prompts(one.spec.vocab_size)[1]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
        (want,) = one.generate([(prompt, greedy.model_copy(update={"n": 1}), adapter)])
        (got,) = two.generate([(prompt, greedy, adapter)])
        assert [c.output_ids for c in got.choices] == [want.output_ids] * 3

    def test_penalties_and_logprobs_equal_tp1(self, demo, engines):
        """Rows with penalties and logprobs beside plain rows, on 2 ranks: rank 0 samples
        from the all-reduced logits, so tokens and logprobs are TP=1's."""
        one, two = engines
        adapter = list(demo.adapters)[3]
        mixed = GREEDY.model_copy(update={"repetition_penalty": 1.2, "presence_penalty": 0.5,
                                          "frequency_penalty": 0.5, "logprobs": 3})  # fmt: skip
        ps = prompts(one.spec.vocab_size, (9, 14, 6))
        reqs = [(ps[0], mixed, adapter), (ps[1], GREEDY, None), (ps[2], mixed, None)]
        want, got = one.generate(reqs), two.generate(reqs)
        assert [s.output_ids for s in got] == [s.output_ids for s in want]
        for a, b in zip(got[0].logprobs + got[2].logprobs, want[0].logprobs + want[2].logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < LOGIT_ATOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]

    def test_cached_prefixes_are_read_on_every_rank(self, demo, engines):
        """Requests sharing a 40-token prefix under one adapter and the base, one per
        step: the later ones start after the cached blocks, which every rank holds (rank
        0's block tables are every rank's); a rank without them would decode otherwise."""
        one, two = engines
        adapter = list(demo.adapters)[2]
        prefix, *suffixes = prompts(one.spec.vocab_size, (40, 3, 5, 7, 2))
        reqs = [(prefix + s, GREEDY, m) for s in suffixes for m in (adapter, None)]
        before = two.scheduler.prefix.hit_tokens
        out = staggered(two, reqs)
        assert out == staggered(one, reqs)
        assert two.scheduler.prefix.hit_tokens - before == 6 * 32  # 3 pairs hit 2 blocks

    def test_each_rank_stages_and_holds_only_its_shard(self, demo, engines):
        _, two = engines
        one_token = SamplingParams(temperature=0, max_tokens=1)
        two.generate([(p, one_token, a) for p, a in zip(prompts(2000, [4] * 8), demo.adapters)])
        staged = ray.get(worker(two).staged_bytes.remote())
        for name in demo.adapters:
            whole, rank0 = expected_shard(two, name, 0)
            _, rank1 = expected_shard(two, name, 1)
            assert two.adapters.host_cache.get(name).nbytes == rank0.nbytes < whole.nbytes
            assert staged[name] == rank1.nbytes < whole.nbytes
        check_rank1_slots(two)

    def test_one_message_per_step_and_lora_adds_only_rank_sized_traffic(self, demo, engines):
        _, two = engines
        comm, spec = two.executor.group.rank.comm, two.spec
        full = [n for n in demo.adapters if len(two.adapters.host_cache.get(n).target_modules) == 7]
        for adapters in ([None] * 3, full):
            ps, sampling = (
                prompts(spec.vocab_size, [6, 7, 8]),
                SamplingParams(temperature=0, max_tokens=4),
            )
            seqs = [two.add_request(GenerateRequest(p, sampling, a)) for p, a in zip(ps, adapters)]
            while not all(s.output_ids for s in seqs):  # prefill (and loads) first
                two.step()
            before = dict(comm.bytes), dict(comm.calls)
            two.step()  # one decode step: 3 tokens
            sent = {k: comm.bytes[k] - before[0].get(k, 0) for k in comm.bytes}
            calls = {k: comm.calls[k] - before[1].get(k, 0) for k in comm.calls}
            t, h, layers = 3, spec.hidden_size, spec.num_layers
            assert calls["step"] == 1  # the batch's metadata: one broadcast
            assert sent["layer"] == 2 * layers * t * h * 4  # o and down all-reduce [T, h] fp32
            lora = 2 * layers * t * two.config.max_lora_rank * 4  # [T, R] fp32 per row layer
            assert sent.get("lora", 0) == (lora if adapters == full else 0)
            for s in seqs:
                two.abort(s)


@pytest.mark.parametrize(
    "arch,overrides",
    [("qwen2", {}), ("llama", {"num_kv_heads": 1}), ("mistral", {"vocab_size": 511})],
    ids=["qwen2-bias-tied", "kv-heads-replicated", "vocab-padded"],
)
def test_model_variants_equal_tp1(arch, overrides):
    assets = tiny_assets(arch, **overrides)
    one, two = engine(assets), engine(assets, tp_size=2)
    try:
        if overrides.get("num_kv_heads") == 1:
            assert (
                two.executor.group.rank.shard.kv_heads == 1
                and two.executor.runner.kv.k[0].shape[0] == 1
            )
        for adapter in [None, *assets.adapters]:
            for p in prompts(one.spec.vocab_size):
                diff = (two.score(p, adapter) - one.score(p, adapter)).abs().max().item()
                assert diff < LOGIT_ATOL, f"{adapter}: {diff}"
        reqs = mixed(assets, one.spec.vocab_size)
        assert staggered(two, reqs) == staggered(one, reqs)
    finally:
        two.shutdown()


def test_adapter_churn_keeps_every_rank_on_rank0s_slots(tiny):
    """More adapters than slots, no host cache: every load, eviction and reload is decided
    by rank 0 and applied by rank 1 to the same slot."""
    two = engine(tiny, tp_size=2, num_slots=2, max_loras_per_batch=2, host_cache_bytes=0)
    try:
        names = [None if i % 5 == 4 else list(tiny.adapters)[i % 4] for i in range(16)]
        lengths = [8 + i % 5 for i in range(16)]
        sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        reqs = [(p, sampling, a) for p, a in zip(prompts(two.spec.vocab_size, lengths), names)]
        seqs = [two.add_request(GenerateRequest(*r)) for r in reqs]
        for _ in range(2000):
            if not two.has_work():
                break
            two.step()
            two.adapters.pool.check_integrity()
            check_rank1_slots(two)
        assert two.adapters.pool.num_evictions > 0, "the test should force evictions"
    finally:
        two.shutdown()
    one = engine(tiny)
    assert [s.output_ids for s in seqs] == [one.generate([r])[0].output_ids for r in reqs]


def test_slots_handed_over_mid_step_are_written_on_every_rank_behind_that_step(monkeypatch):
    """Batches that end at once hand their slots to the next adapters during their last
    step: rank 0 writes behind its own step, rank 1 behind the same step of its own (by
    the step's number). Rank 1's slots hold rank 0's adapters after every step and the
    tokens equal TP=1's. Before, all ranks warm up at once (rank 0's message, collectives
    paired); rank 0 'captures' graphs (a fake) that rank 1 cannot (CPU), so every rank
    drops its graphs: no rank replays a collective another runs eagerly."""
    many = tiny_assets("llama", num_adapters=16)
    names = [n for n, p in many.adapters.items() if peft_rank(p) == 64]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = {"num_slots": 3, "max_loras_per_batch": 2, "host_cache_bytes": 0}
    two = engine(many, tp_size=2, **kw)
    try:
        runner = two.executor.runner
        static = runner.make_static_decode(4)

        def capture() -> None:  # graphs on rank 0 only (recorded, nothing run)
            static.capture(FakeGraphs(run=False))
            runner.static_decode = static

        monkeypatch.setattr(runner, "capture", capture)
        two.executor.group.warm_up(runner)  # what a CUDA group does at start
        assert static.num_graphs == 0 and two.executor.group.rank_graphs == [0]
        runner.static_decode = None  # rank 1 has none either (CPU)
        reqs = [(p, sp, names[i % len(names)]) for i, p in enumerate(prompts(512, [8] * 8))]
        seqs = [two.add_request(GenerateRequest(*r)) for r in reqs]
        for _ in range(2000):
            if not two.has_work():
                break
            two.step()
            check_rank1_slots(two)
        assert two.adapters.prefetcher.handovers >= 2
        stats = two.graph_stats()
        assert stats["graphs_captured"] == 0 and stats["graph_replays"] == 0  # CPU: eager
        assert stats["eager_decode_steps"] > 0
    finally:
        two.shutdown()
    one = engine(many, **kw)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in one.generate(reqs)]


def test_unload_and_register_again_reaches_every_rank(tiny):
    one, two = engine(tiny), engine(tiny, tp_size=2)
    p = prompts(one.spec.vocab_size)[1]
    try:
        two.load_adapter("x", tiny.adapters["adapter-00"])
        first = two.generate([(p, GREEDY, "x")])[0].output_ids
        assert first == one.generate([(p, GREEDY, "adapter-00")])[0].output_ids
        two.unload_adapter("x")
        with pytest.raises(RequestError, match="unknown adapter 'x'"):
            two.add_request(GenerateRequest(p, GREEDY, "x"))
        two.load_adapter("x", tiny.adapters["adapter-01"])  # same name, other weights
        again = two.generate([(p, GREEDY, "x")])[0].output_ids
        assert again == one.generate([(p, GREEDY, "adapter-01")])[0].output_ids != first
    finally:
        two.shutdown()


def test_a_dead_rank_is_a_clear_error_not_a_hang(tiny):
    two = engine(tiny, tp_size=2)
    p = prompts(two.spec.vocab_size)[0]
    try:
        assert two.generate([(p, GREEDY, "adapter-00")])[0].finish_reason == "length"
        pid = ray.get(worker(two).ready.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        [load] = two.generate([(p, GREEDY, "adapter-01")], max_steps=10_000)  # never in a slot
        assert load.finish_reason == "error"
        assert "tensor-parallel rank 1 of 2 failed" in str(load.group.error)
        with pytest.raises(TPRankError, match="tensor-parallel rank 1 of 2 failed"):
            two.generate([(p, GREEDY, None)], max_steps=100)
        assert time.monotonic() - started < 30
        with pytest.raises(TPRankError, match="rank 1 of 2"):
            two.check_health()
    finally:
        started = time.monotonic()
        two.shutdown()
        assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    "family",
    ["qwen3", "gemma2", "phi3", "qwen3moe", "gptoss", "gemma4", "gemma4moe", "qwen35", "qwen35moe"],
)
def test_families_equal_tp1(family, tmp_path):
    """Qwen3 (q/k norms, head_dim ≠ hidden / heads), Gemma 2 (soft-caps, windows, four
    norms, scaled embedding), Phi-3 (fused checkpoint projections, partial rotary) and
    Qwen3-MoE (every expert's columns split, gate/up by rows and down by columns, their
    expert LoRA likewise; a dense layer between) and gpt-oss (sinks split with their
    heads, o_proj and down biases added once, interleaved gate/up and their biases split)
    and Gemma 4 (each layer split by its own head_dim and KV heads, its one global KV head
    kept on both ranks, shared KV, per-layer inputs replicated) and Qwen3.5 (Gated DeltaNet
    heads, their conv channels, decays and states split, the gated attention's q and gate
    rows with their heads; LoRA on in_proj_* and out_proj; Qwen3.5-MoE's shared expert
    split like the dense MLP, its gate whole) on 2 ranks: logits and a staggered mixed
    batch equal TP=1, adapters included."""
    from cluster.demo.families import family_model_dir
    from tests.oracle import family_adapters

    model_dir = family_model_dir(family)
    adapters = family_adapters(family, model_dir, tmp_path)
    # the MoE families' "all" adapters hold expert LoRA
    check_tp2_equals_tp1(model_dir, adapters, family, lora_experts=True)


def test_embedding_and_head_lora_equal_tp1(tmp_path):
    """engine.lora_embeddings on 2 ranks, a vocabulary of 511 (the last rank's head rows
    padded): the embedding LoRA whole on each rank after the all-reduce, the head's B split
    by vocabulary rows; logits and a staggered mixed batch equal TP=1."""
    from tests.oracle import peft_adapter

    assets = tiny_assets("llama", vocab_size=511)
    targets = ["q_proj", "o_proj", "embed_tokens", "lm_head"]
    adapter = peft_adapter(assets.model_dir, tmp_path / "v", targets, r=8, alpha=16, seed=4)

    def build(tp_size: int) -> LLMEngine:
        cfg = EngineConfig(model=str(assets.model_dir), device="cpu", tp_size=tp_size,
                           kv_cache_bytes=16 << 20, lora_embeddings=True)  # fmt: skip
        eng = LLMEngine(cfg)
        eng.load_adapter("vocab", adapter)
        return eng

    one = build(1)
    two = build(2)
    try:
        for p in prompts(one.spec.vocab_size, (5, 23)):
            diff = (two.score(p, "vocab") - one.score(p, "vocab")).abs().max().item()
            assert diff < LOGIT_ATOL, f"max |TP2 - TP1 logit| {diff}"
        reqs = [(p, GREEDY, a) for p, a in zip(prompts(511, (3, 17, 9)), [None, "vocab", "vocab"])]
        assert staggered(two, reqs) == staggered(one, reqs)
    finally:
        two.shutdown()
        one.shutdown()


def test_mxfp4_experts_cut_inside_a_group_equal_tp1(tmp_path):
    """gpt-oss's MXFP4 experts of 96 columns on 2 ranks of 48: each rank holds the
    32-group its columns end (rank 0: 0:64) or start (rank 1: 32:96) inside, gate/up rows,
    biases and expert LoRA B rows of the columns it borrows zero, its down LoRA A columns
    zero: logits and a staggered mixed batch of the base, an attention adapter and one on
    attention and the experts equal TP=1."""
    from cluster.demo.families import family_model_dir
    from replica.model.spec import load_model_spec
    from tests.oracle import family_adapters
    from tests.quant_checkpoints import mxfp4_copy

    dense = family_model_dir("gptoss", overrides={"intermediate_size": 96})
    model_dir = mxfp4_copy(dense, tmp_path / "mxfp4")
    spec = load_model_spec(model_dir)
    assert [TPShard(spec, rank, 2).expert_held_range for rank in (0, 1)] == [(0, 64), (32, 96)]
    adapters = family_adapters("gptoss", dense, tmp_path)
    check_tp2_equals_tp1(model_dir, adapters, "mxfp4", lora_experts=True)


@pytest.mark.parametrize(
    ("family", "fmt"),
    [("qwen3", "ct-fp8-channel"), ("qwen3", "ct-w4a16-g16"), ("qwen3moe", "ct-w4a16-g16")],
)
def test_quantized_bases_equal_tp1(family, fmt, tmp_path):
    """Packed bases on 2 ranks, each holding its rows (q/k/v, gate/up, expert gate/up) or
    columns (o, down, expert down) of the packed tensors cut along whole groups: logits and
    a staggered mixed batch with adapters equal TP=1 (itself checked against transformers
    in tests/replica/model/test_quantized.py)."""
    from cluster.demo.families import family_model_dir
    from tests.oracle import family_adapters
    from tests.quant_checkpoints import quantize_dir

    src = family_model_dir(family)
    model_dir = tmp_path / fmt
    quantize_dir(src, model_dir, fmt)
    adapters = family_adapters(family, src, tmp_path)

    check_tp2_equals_tp1(model_dir, adapters, fmt, lora_experts=True)  # qwen3moe's experts
