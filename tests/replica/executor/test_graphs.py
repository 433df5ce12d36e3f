"""Decode graphs on the CPU, with a fake of the CUDA calls (capture runs the step once and
keeps it, replay runs it again): one shared logits buffer, what a failed capture does,
the counters of how decode steps ran, hand-over steps that stay in graph mode, and the
block tables sent by the width in use. The real capture runs in test_engine_cuda.py."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

import kernels
from cluster.demo.families import family_model_dir
from replica.device import StagedBuffer, StepClock, StepProgress, packed_offsets
from replica.executor import static_decode as sd
from replica.executor.static_decode import (
    DecodeInputs,
    StaticDecode,
    logits_bytes,
    static_decode_bytes,
)
from replica.wire import GenerateRequest, SamplingParams
from tests.conftest import tiny_assets
from tests.engines import make_engine
from tests.fakes import FakeGraphs
from tests.oracle import family_adapters
from tests.replica.executor.steps import (
    decoding,
    next_plan,
    prompt,
    static_for,
    triton_kernels,
)


def adapter_rank(path) -> int:
    return json.loads((path / "adapter_config.json").read_text())["r"]


def captured(static: StaticDecode, graphs: FakeGraphs | None = None) -> FakeGraphs:
    graphs = graphs or FakeGraphs()
    static.warm_up()
    static.capture(graphs)
    return graphs


def graph_engine(assets, max_seqs: int = 8, **kw):
    """A CPU engine whose decode steps take the static path, every bucket 'captured'."""
    eng = make_engine(assets, **kw)
    runner = eng.executor
    runner.static_decode = runner.make_static_decode(max_seqs)
    graphs = captured(runner.static_decode)
    return eng, graphs


# -- one shared logits buffer ---------------------------------------------------------------


def test_every_graph_writes_one_shared_logits_buffer_and_keeps_no_output(tiny, monkeypatch):
    """Each bucket's forward output lives only while its capture runs: what a graph leaves
    is its logits copied into the one [max_num_seqs, vocab] buffer, and a step's result is
    a view of that buffer's first rows, equal to the bucket's forward."""
    eng = make_engine(tiny)
    names = list(tiny.adapters)
    decoding(eng, [(5, names[0]), (9, None), (3, names[2])])
    static = static_for(eng, 8)
    outputs = []
    real = static.forward
    monkeypatch.setattr(static, "forward", lambda *a: outputs.append(real(*a)) or outputs[-1])
    static.warm_up()
    outputs.clear()
    static.capture(FakeGraphs())
    assert static.num_graphs == 2 * len(static.buckets)
    dead = [weakref.ref(t) for t in outputs]
    outputs.clear()
    assert all(ref() is None for ref in dead), "a graph keeps its own logits"
    plan, _ = next_plan(eng)
    got = static.run(plan, eng.executor.lora.table.ranks)
    vocab = eng.spec.vocab_size
    assert static.logits.shape == (8, vocab) and static.logits.dtype == torch.float32
    assert got.data_ptr() == static.logits.data_ptr() and got.shape == (3, vocab)
    assert torch.equal(got, real(4, True)[:3])
    assert static.replays == 1


def test_the_bytes_a_static_decode_holds_are_the_ones_it_allocates(tiny):
    """static_decode_bytes (what the memory plan counts) against the storages a
    StaticDecode holds beyond model and cache; the logits part at Llama-3.1-8B shapes is
    one buffer of max_num_seqs x vocab floats, not one per graph."""
    eng = make_engine(tiny)
    static = static_for(eng, 24)
    inputs = static.inputs
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in (static.logits, *inputs.tensors.values(), inputs.block_tables, inputs.seg_indptr)
    }
    want = static_decode_bytes(24, eng.spec.vocab_size, static.max_blocks_per_seq)
    assert sum(held.values()) == want
    assert logits_bytes(256, 128_256) == 256 * 128_256 * 4  # 125 MiB at max_num_seqs 256
    per_graph = 2 * sum(sd.decode_buckets(256)) * 128_256 * 4  # what each graph held before
    assert per_graph > 30 * logits_bytes(256, 128_256)


# -- capture failures -----------------------------------------------------------------------


def test_out_of_memory_in_capture_leaves_decode_eager_and_names_the_bytes(tiny, caplog):
    eng = make_engine(tiny)
    decoding(eng, [(5, None), (9, list(tiny.adapters)[1])])
    static = static_for(eng, 8)
    oom = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"
    )
    with caplog.at_level(logging.WARNING, logger=sd.__name__):
        captured(static, FakeGraphs(oom, fail_at=3))
    assert static.num_graphs == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "2.00 GiB" in warning and "123456789 bytes free" in warning
    plan, _ = next_plan(eng)
    got = static.run(plan, eng.executor.lora.table.ranks).clone()
    assert torch.equal(got, static.forward(2, True)[:2])  # the same inputs, eagerly
    assert (static.replays, static.eager_steps) == (0, 1)


@pytest.mark.parametrize(
    "error", [RuntimeError("CUDA error: an illegal memory access"), ValueError("bad op")]
)
def test_any_other_capture_failure_fails_the_start(tiny, error):
    """Not a slow path: a device fault or an op that cannot be captured stops the replica
    from starting, naming the bucket."""
    static = static_for(make_engine(tiny), 8)
    with pytest.raises(RuntimeError, match=r"decode bucket 8 \(without LoRA\)") as raised:
        captured(static, FakeGraphs(error, fail_at=1))
    assert raised.value.__cause__ is error
    assert static.num_graphs == 0


# -- counters -------------------------------------------------------------------------------


def counted_steps(eng) -> list[bool]:
    """Record, per step the executor runs, whether its plan is decode-only."""
    decode_only: list[bool] = []
    real = eng.executor.execute

    def execute(plan, *a, **kw):
        decode_only.append(not plan.prefill_starts)
        return real(plan, *a, **kw)

    eng.executor.execute = execute
    return decode_only


def requests(tiny, n: int = 6, max_tokens: int = 6):
    names = [None, *tiny.adapters]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [(prompt(i, 3 + 4 * i), sp, names[i % len(names)]) for i in range(n)]


def test_graph_stats_count_replays_and_eager_decode_steps(tiny):
    eng, _ = graph_engine(tiny)
    steps = counted_steps(eng)
    eng.generate(requests(tiny))
    stats = eng.graph_stats()
    assert stats == {
        "graphs_captured": 2 * len(eng.executor.static_decode.buckets),
        "graph_replays": sum(steps),
        "eager_decode_steps": 0,
    }
    assert sum(steps) > 3 and not all(steps)
    assert {k: eng.drain_telemetry()[k] for k in stats} == stats

    eager = make_engine(tiny)  # the CPU engine: no static path, every decode step eager
    steps = counted_steps(eager)
    eager.generate(requests(tiny))
    assert eager.graph_stats() == {
        "graphs_captured": 0, "graph_replays": 0, "eager_decode_steps": sum(steps),
    }  # fmt: skip


# -- hand-over in graph mode ----------------------------------------------------------------


def test_a_hand_over_step_replays_its_graph_and_writes_behind_the_replay(tiny, monkeypatch):
    """Batches of two adapters that end at once, through two slots: their slots are handed
    to the next adapters during that last decode step, which still replays its graph;
    every handed-over write waits for the replay to be done (StepProgress.step_done), and
    the tokens are the eager engine's."""
    many = tiny_assets("llama", num_adapters=16)  # rank-64 ones: each batch's blocks fit
    names = [n for n, p in many.adapters.items() if adapter_rank(p) == 64]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    reqs = [(prompt(i, 8), sp, names[i % len(names)]) for i in range(8)]
    kw = {"num_slots": 3, "max_loras_per_batch": 2}
    want = [s.output_ids for s in make_engine(many, **kw).generate(reqs)]
    eng, graphs = graph_engine(many, **kw)
    timeline = graphs.log
    real_wait = StepProgress.wait_layer

    def wait_layer(progress, layer):
        real_wait(progress, layer)
        timeline.append(("write", id(progress)))

    def step_done(progress, _real=StepProgress.step_done):
        timeline.append(("step_done", id(progress)))
        _real(progress)

    monkeypatch.setattr(StepProgress, "wait_layer", wait_layer)
    monkeypatch.setattr(StepProgress, "step_done", step_done)
    got = [s.output_ids for s in eng.generate(reqs)]
    assert got == want
    assert eng.adapters.prefetcher.handovers > 0
    done_at = {e[1]: i for i, e in enumerate(timeline) if e[0] == "step_done"}
    assert done_at, "no hand-over step took the graph path"
    steps = [e for e in timeline if e == "replay" or e[0] == "step_done"]  # the step thread's
    assert all(steps[steps.index(e) - 1] == "replay" for e in steps if e != "replay")
    writes = [(i, e[1]) for i, e in enumerate(timeline) if e[0] == "write" and e[1] in done_at]
    assert writes, "no slot was written behind a replay"
    assert all(done_at[p] < i for i, p in writes), "a slot written before its step's replay"
    assert eng.graph_stats()["eager_decode_steps"] == 0


def test_the_path_a_step_takes_does_not_depend_on_a_hand_over(tiny):
    """Every rank of a tensor-parallel group must run the same shapes; only rank 0 sees
    the hand-over, so the path is chosen from the plan alone."""
    eng, _ = graph_engine(tiny)
    decoding(eng, [(5, None), (9, list(tiny.adapters)[0])])
    plan, _ = next_plan(eng)
    runner, table = eng.executor, eng.executor.lora.table
    before = runner.graph_stats()["graph_replays"]  # decoding() may have replayed already
    runner.execute(plan, table)
    runner.execute(plan, table, progress=StepProgress(torch.device("cpu")))
    assert runner.graph_stats()["graph_replays"] == before + 2


def test_step_progress_of_a_replay_releases_every_layer_at_once():
    progress = StepProgress(torch.device("cpu"), timeout_s=5)
    released = []
    threads = [
        threading.Thread(target=lambda i=i: (progress.wait_layer(i), released.append(i)))
        for i in (0, 3, 99)
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert not released
    progress.step_done()
    for t in threads:
        t.join(5)
    assert sorted(released) == [0, 3, 99]


def test_step_progress_gives_the_step_number_once_the_step_begins():
    progress = StepProgress(torch.device("cpu"), timeout_s=5)
    got = []
    waiter = threading.Thread(target=lambda: got.append(progress.step_number()))
    waiter.start()
    time.sleep(0.1)
    assert not got
    progress.begin(41)
    waiter.join(5)
    assert got == [41]
    never = StepProgress(torch.device("cpu"), timeout_s=5)
    never.finish()
    with pytest.raises(RuntimeError, match="ended before it began"):
        never.step_number()


def test_step_clock_holds_a_write_until_its_step_is_issued():
    clock = StepClock(torch.device("cpu"))
    done = []
    waiter = threading.Thread(target=lambda: (clock.wait(2, 5), done.append(1)))
    waiter.start()
    clock.issued(0)
    clock.issued(1)
    time.sleep(0.1)
    assert not done
    clock.issued(2)
    waiter.join(5)
    assert done
    clock.wait(1, 0.01)  # long issued: returns at once
    with pytest.raises(TimeoutError, match="step 3"):
        clock.wait(3, 0.05)


# -- block tables by the width in use -------------------------------------------------------


def test_a_decode_step_sends_only_the_block_table_columns_in_use(tiny, monkeypatch):
    """The graphs read tables as wide as the longest context allowed; a step fills and
    sends the columns its sequences use, not the full width."""
    eng = make_engine(tiny, block_size=1, max_model_len=2048)  # 2048 columns per row
    decoding(eng, [(5, None), (9, None), (3, None)])
    static = static_for(eng, 8)
    assert static.max_blocks_per_seq == 2048
    sent = []
    real_upload = StagedBuffer.upload

    def upload(buffer, nbytes=None):
        sent.append(buffer._device_bytes.numel() if nbytes is None else nbytes)
        real_upload(buffer, nbytes)

    monkeypatch.setattr(StagedBuffer, "upload", upload)
    plan, _ = next_plan(eng)
    before = static.inputs.block_tables.clone()
    logits = static.run(plan, eng.executor.lora.table.ranks).clone()
    width = max(len(t) for t in plan.decode_tables)
    assert width == 10  # the 9-token prompt and its first output token
    bucket = static.bucket(3)
    assert sent == [static.inputs.buffer.offsets["table_rows"] + bucket * width * 4]
    assert sent[0] < 8 * 2048 * 4 // 10  # a tenth of the full tables at most
    tables = static.inputs.block_tables
    assert torch.equal(tables[:, width:], before[:, width:])  # the rest untouched
    for i, blocks in enumerate(plan.decode_tables):
        assert tables[i, : len(blocks)].tolist() == blocks
    assert (tables[3:bucket, 0] == static.inputs.scratch_block).all()
    eager = eng.executor.execute(plan, eng.executor.lora.table)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-4)


def test_packed_fields_are_16_byte_aligned():
    """Kernels see one pointer alignment whatever a step's sizes (a new one would compile
    another specialisation mid-serving)."""
    offsets, end = packed_offsets({"a": 3 * 8, "b": 5 * 4, "c": 1, "d": 7 * 4})
    assert all(o % 16 == 0 for o in offsets.values()) and end == offsets["d"] + 28
    inputs = DecodeInputs(5, 7, 4, 9, torch.device("cpu"))
    assert all(o % 16 == 0 for o in inputs.buffer.offsets.values())


# -- Triton warm-up -------------------------------------------------------------------------


@pytest.fixture(params=["llama", "qwen3moe", "gemma2", "qwen35"])
def warm_model(request, tiny, tmp_path):
    """The tiny Llama, a tiny mixture of experts with expert LoRA, a tiny Gemma 2 (sliding
    windows of 8, soft caps)."""
    if request.param == "llama":
        return tiny
    model_dir = family_model_dir(request.param)
    return SimpleNamespace(
        model_dir=model_dir, adapters=family_adapters(request.param, model_dir, tmp_path)
    )


def test_warm_up_launches_every_kernel_specialisation_serving_does(warm_model, monkeypatch):
    """The compile keys (constexprs, options, Triton's specialisation of every argument) of
    the Triton launches a served workload makes, against those of the start's warm-up: none
    new, so nothing compiles under a request. The workload mixes prefills of 1 to 300
    tokens, chunked ones, decodes of 1 to 20 sequences on the static path and eagerly
    (attention split or not: an H100's SM count stands in), base and adapter rows; the odd
    max_lora_rank puts the LoRA workspace's regions at addresses whose alignment changes
    with the step's token count. Launches are recorded, not run (which launches a step
    makes depends on sizes, never on values)."""
    from tests.kernels.launches import recorded_launches

    assets = warm_model
    names = [None, *assets.adapters]
    monkeypatch.setattr(kernels, "_cuda_sm_count", lambda: 132)
    with kernels.forced_backend("triton"):
        eng = make_engine(assets, max_lora_rank=65, max_num_seqs=20, block_size=4,
                          max_num_batched_tokens=48, lora_experts=True)  # fmt: skip
        runner = eng.executor
        runner.static_decode = runner.make_static_decode(20)
        with recorded_launches(monkeypatch, *triton_kernels(), execute=False) as warm:
            runner.warm_up()
        long = min(300, eng.max_model_len - 16)
        with recorded_launches(monkeypatch, *triton_kernels(), execute=False) as served:
            for wave, lengths in enumerate(([1, 2, 17, 40, 3], list(range(1, 16)), [5, 62, long])):
                for i, n in enumerate(lengths):
                    sp = SamplingParams(temperature=0, max_tokens=3 + i % 5, ignore_eos=True)
                    ids = [t % eng.spec.vocab_size for t in prompt(i + 20 * wave, n)]
                    eng.add_request(GenerateRequest(ids, sp, names[(i + wave) % len(names)]))
                    if i % 4 == 0:
                        eng.step()
                if wave == 1:
                    runner.static_decode = None  # engine.cuda_graphs: false from here
            while eng.has_work():
                eng.step()
            eng.generate([([7], SamplingParams(temperature=0, max_tokens=3), None)])  # 1 block
            eng.score([t % eng.spec.vocab_size for t in prompt(3, 9)], names[1])
    warmed = {(launch.kernel, launch.key) for launch in warm}
    new = {(launch.kernel, launch.key) for launch in served} - warmed
    strides = {dict((k[0], k[1:]) for k in launch.key[:-1])["stride_td"] for launch in served
               if launch.kernel == "_paged_decode_kernel"}  # fmt: skip
    assert len(strides) == 3  # table widths of 1, a multiple of 16 and others were served
    assert not new, f"{len(new)} launches would compile while serving: {sorted(new)[:2]}"
    launched = {k.fn.__name__ for k in triton_kernels()}
    if not eng.spec.num_experts:
        launched.remove("_grouped_gemm_kernel")
    if eng.spec.linear_attention is None:
        launched -= {"_conv_kernel", "_recurrent_kernel", "_chunked_kernel"}
    if eng.max_model_len <= 256:  # too short to split a decode's attention
        launched.remove("_merge_splits_kernel")
    assert {launch.kernel for launch in served} == launched
    assert max(len(launch.args["x_ptr"]) for launch in served if "x_ptr" in launch.args) > 16
