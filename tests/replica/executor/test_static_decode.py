"""The fixed-shape decode path that CUDA graphs replay, checked on the CPU: persistent
inputs, bucket padding, the same ops over the same buffers every step of a bucket, and
tokens equal to the eager engine's. (`pytest -k "graph or paged or persistent or bucket"`
selects these; the CUDA capture itself is tested in test_engine_cuda.py on a GPU.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import sgmv_torch
from replica.executor.static_decode import decode_buckets
from replica.wire import SamplingParams
from tests.engines import make_engine
from tests.replica.executor.steps import decoding, next_plan, prompt, static_for

SCALAR_READS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}


def test_decode_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    static_buckets = decode_buckets(20)
    assert static_buckets == [1, 2, 4, 8, 16, 20]


def test_a_padded_bucket_gives_the_unpadded_logits_and_writes_kv_only_to_scratch(tiny):
    """5 sequences padded to a bucket of 8. Whatever the padding rows hold, the real rows'
    logits are bit-identical (nothing of the padding reaches them); against the same 5 in
    a bucket of exactly 5, and against the eager step, they agree to float rounding (a
    GEMM of 8 rows is blocked differently from one of 5) with the same tokens; and the
    padding's K/V lands in the scratch block only."""
    eng = make_engine(tiny)
    names = list(tiny.adapters)
    decoding(eng, [(5, names[0]), (19, None), (9, names[1]), (33, names[2]), (3, names[0])])
    plan, _ = next_plan(eng)
    runner, ranks = eng.executor, eng.executor.lora.table.ranks
    saved = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]

    def restore() -> None:
        for t, before in zip((*runner.kv.k, *runner.kv.v), saved):
            t.copy_(before)

    padded = static_for(eng, 8)
    assert padded.bucket(5) == 8
    got = padded.run(plan, ranks).clone()
    written = [t.clone() for t in runner.kv.k]
    restore()
    host = padded.inputs.buffer.writable()  # other padding: tokens, positions, an adapter
    host["input_ids"][5:] = torch.tensor([7, 99, 250])
    host["positions"][5:] = torch.tensor([0, 3, 1])
    host["token_slots"][5:] = torch.tensor([0, 1, 2], dtype=torch.int32)
    padded.inputs.buffer.upload()
    assert torch.equal(padded.forward(8, lora=True)[:5], got)
    restore()
    exact = static_for(eng, 5).run(plan, ranks)
    restore()
    eager = runner.execute(plan, runner.lora.table)
    assert got.shape == exact.shape == eager.shape == (5, eng.spec.vocab_size)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-4)
    assert got.argmax(-1).tolist() == exact.argmax(-1).tolist() == eager.argmax(-1).tolist()

    bs = eng.config.block_size
    scratch = set(range(runner.scratch_block * bs, (runner.scratch_block + 1) * bs))
    allowed = scratch | set(plan.decode_new_slots)
    for layer, before in zip(written, saved):
        changed = (layer != before).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= allowed
        assert set(changed) & scratch, "the padding rows wrote nothing to the scratch block"
    assert runner.scratch_block == eng.scheduler.allocator.num_blocks  # never handed out


class OpTrace(TorchDispatchMode):
    """Every aten op with its tensor arguments' shapes, and which persistent buffer (by
    name) each argument reads, if any."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.ranges = {
            name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for name, t in buffers.items()
        }
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a
                    if isinstance(t, torch.Tensor)]  # fmt: skip
        self.ops.append(
            (
                str(func.overloadpacket),
                tuple((tuple(t.shape), t.dtype) for t in tensors),
                tuple(self._owner(t) for t in tensors),
            )
        )
        return func(*args, **kwargs)

    def _owner(self, t: torch.Tensor) -> tuple[str, int] | None:
        if t.device.type == "meta":
            return None
        ptr = t.data_ptr()
        for name, (lo, hi) in self.ranges.items():
            if lo <= ptr < hi:
                return name, ptr - lo
        return None


def test_graph_steps_of_a_bucket_run_the_same_ops_on_the_same_buffers(tiny, monkeypatch):
    """Two decode steps in one bucket with different batch sizes, adapters and context
    lengths: the same op sequence, shapes, and persistent metadata at the same addresses,
    and no scalar read of a device value (nor the eager path's host-side plan)."""

    def host_plan(*args, **kwargs):
        raise AssertionError("the static path read LoRA metadata on the host")

    names = list(tiny.adapters)
    traces = []
    for requests in (
        [(5, names[0]), (19, None), (9, names[1]), (33, names[2]), (3, names[0])],
        [
            (12, names[3]),
            (2, names[1]),
            (7, None),
            (21, names[1]),
            (4, names[2]),
            (8, None),
            (15, names[0]),
        ],  # fmt: skip
    ):
        eng = make_engine(tiny)
        decoding(eng, requests)
        static = static_for(eng, 8)
        plan, _ = next_plan(eng)
        assert static.bucket(len(plan.decode_context_lens)) == 8
        buffers = dict(static.inputs.tensors, block_tables=static.inputs.block_tables)
        buffers |= {f"ranks.{g}": t for g, t in eng.executor.slot_tensors.ranks.items()}
        buffers["scalings"] = eng.executor.slot_tensors.scalings
        buffers |= {f"offsets.{g}": t for g, t in eng.executor.slot_tensors.offsets.items()}
        buffers["seg_indptr"] = static.inputs.seg_indptr
        static.inputs.fill(plan, 8)
        trace = OpTrace(buffers)
        with monkeypatch.context() as patch, trace:
            patch.setattr(sgmv_torch, "_plan", host_plan)
            static.forward(8, lora=True)
        traces.append(trace.ops)
    first, second = traces
    assert [op[:2] for op in first] == [op[:2] for op in second]  # ops and shapes
    assert [op[2] for op in first] == [op[2] for op in second]  # persistent buffers read
    read = {name for op in first for owner in op[2] if owner for name in [owner[0]]}
    assert {"block_tables", "context_lens", "token_slots", "scalings", "offsets.qkv_proj"} <= read
    assert not SCALAR_READS & {op[0] for op in first}


@pytest.mark.parametrize("with_lora", [True, False])
def test_graph_lora_launches_two_per_group_and_layer_or_none(tiny, monkeypatch, with_lora):
    """With an adapter in the batch: one shrink and one expand per projection group per
    layer (no separate zero fill: one workspace per step); base only: none at all."""
    calls = {"shrink": 0, "expand": 0}
    for op in calls:
        real = getattr(kernels, f"lora_{op}")

        def counted(*a, _real=real, _op=op, **kw):
            calls[_op] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, f"lora_{op}", counted)
    names = list(tiny.adapters)
    eng = make_engine(tiny)
    decoding(eng, [(6, names[1] if with_lora else None), (4, None), (9, None)])
    static = static_for(eng, 4)
    plan, _ = next_plan(eng)
    calls.update(shrink=0, expand=0)
    static.run(plan, eng.executor.lora.table.ranks)
    per_step = eng.spec.num_layers * 4 if with_lora else 0
    assert calls == {"shrink": per_step, "expand": per_step}


def test_persistent_slot_tensors_are_sent_only_when_they_change(tiny):
    """Slot ranks, scalings and offsets live on the device between steps: a copy only
    after a slot is activated or cleared, not every step."""
    eng = make_engine(tiny, num_slots=2)  # one adapter slot: every new adapter reloads it
    names = list(tiny.adapters)
    slots = eng.executor.slot_tensors
    before = slots.uploads
    eng.generate([(prompt(1, 6), SamplingParams(temperature=0, max_tokens=8), None)])
    assert slots.uploads <= before + 1  # at most the first step's
    steady = slots.uploads
    eng.generate([(prompt(2, 6), SamplingParams(temperature=0, max_tokens=8), names[0])])
    after_one = slots.uploads
    assert after_one > steady  # the slot was activated
    eng.generate([(prompt(3, 6), SamplingParams(temperature=0, max_tokens=8), names[0])])
    assert slots.uploads == after_one  # resident: nothing to send
    table = eng.executor.lora.table
    assert slots.ranks["qkv_proj"].tolist() == table.ranks["qkv_proj"]
    assert slots.scalings.tolist() == pytest.approx(table.scalings)
    assert {g: t.tolist() for g, t in slots.offsets.items()} == table.offsets


def test_static_decode_bucket_engine_tokens_match_eager_across_loads(tiny):
    """An engine whose decode steps take the static path (what graphs replay), with more
    adapters than slots so adapters load and slots activate mid-run: the eager engine's
    tokens exactly."""
    names = list(tiny.adapters)
    requests = [
        (prompt(i, 3 + 5 * i % 17), SamplingParams(temperature=0, max_tokens=9), a)
        for i, a in enumerate([names[0], None, names[1], names[2], None, names[3], names[1]])
    ]
    want = [s.output_ids for s in make_engine(tiny, num_slots=3).generate(requests)]
    eng = make_engine(tiny, num_slots=3)
    runner = eng.executor
    runner.static_decode = runner.make_static_decode(eng.config.max_num_seqs)
    used = []
    real_run = runner.static_decode.run
    runner.static_decode.run = lambda *a: used.append(1) or real_run(*a)
    got = [s.output_ids for s in eng.generate(requests)]
    assert used, "no step took the static decode path"
    assert got == want
    assert eng.adapters.prefetcher.loads_started > 2  # adapters churned through the slots
