"""Adapter arenas: a load writes exactly the adapter's rank rows (and layer by layer
behind a running step when handed over); the slot table says where each adapter is."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replica import device as dev
from replica.adapters.host_cache import HostCache
from replica.device import StepProgress
from replica.executor.batch import SlotTensors
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import load_model_spec


def adapter(spec, name: str, rank: int, modules: tuple[str, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = spec.module_shapes()
    weights = {
        (layer, m): (
            torch.randn(rank, shapes[m][0], generator=g),
            torch.randn(shapes[m][1], rank, generator=g),
        )
        for layer in range(spec.num_layers)
        for m in modules
    }
    return LoRAAdapterWeights(name, rank, 1.0, modules, weights)


def test_an_adapter_is_written_into_its_rank_rows_and_nowhere_else(tiny):
    """Each adapter holds only its own rank's rows of every arena: A rows per slice, B
    columns; a targeted group's untargeted slices are zero there, untargeted groups and
    every other row are left as they were (another adapter's weights stay intact)."""
    spec = load_model_spec(tiny.model_dir)
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    big = adapter(spec, "big", 16, all_modules, 0)
    mid = adapter(spec, "mid", 8, ("q_proj", "v_proj", "down_proj"), 1)
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    assert bufs.num_rows == 32
    bufs.write(0, big)
    bufs.write(16, mid)
    bufs.write(24, adapter(spec, "small", 4, ("k_proj",), 2))
    bufs.write(24, mid)  # rows [24, 32): mid again, over a smaller adapter
    for layer, groups in enumerate(bufs.layers):
        for buf in groups.values():
            for j, module in enumerate(buf.slice_names):
                c0, c1 = buf.slice_offsets[j], buf.slice_offsets[j + 1]
                a, b = big.weights[(layer, module)]
                assert torch.equal(buf.a[j, 0:16], a) and torch.equal(buf.b[c0:c1, 0:16], b)
                for row0 in (16, 24):
                    got_a, got_b = buf.a[j, row0 : row0 + 8], buf.b[c0:c1, row0 : row0 + 8]
                    if (layer, module) in mid.weights:
                        a, b = mid.weights[(layer, module)]
                        assert torch.equal(got_a, a) and torch.equal(got_b, b)
                    elif any(m in mid.target_modules for m in buf.slice_names):
                        assert not got_a.any() and not got_b.any()  # e.g. k of mid's qkv
                    elif row0 == 16:  # o_proj, gate_up: mid does not write them at all
                        assert not got_a.any() and not got_b.any()


def test_the_slot_table_says_where_each_adapter_is(tiny):
    spec = load_model_spec(tiny.model_dir)
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    assert bufs.num_slots == 2 + 32 // 8  # the base, one per smallest block, the spare
    bufs.activate(
        3, {"qkv_proj": 24, "down_proj": 8}, adapter(spec, "mid", 8, ("q_proj", "down_proj"), 1)
    )
    view = bufs.view()
    assert view.scalings[3] == 1.0
    assert {g: o[3] for g, o in view.offsets.items()} == {
        "qkv_proj": 24, "o_proj": 0, "gate_up_proj": 0, "down_proj": 8,
    }  # fmt: skip
    assert {g: r[3] for g, r in view.ranks.items()} == {
        "qkv_proj": 8, "o_proj": 0, "gate_up_proj": 0, "down_proj": 8,
    }  # fmt: skip
    bufs.clear(3)
    assert view.offsets["qkv_proj"][3] == 24 and bufs.table.offsets["qkv_proj"][3] == 0  # a copy
    assert all(r[3] == 0 for r in bufs.table.ranks.values())
    with pytest.raises(ValueError, match="slot 0"):
        bufs.activate(0, 0, adapter(spec, "x", 8, ("q_proj",), 1))
    with pytest.raises(ValueError, match="qkv_proj: rows \\[30, 38\\) outside the arena"):
        bufs.write(30, adapter(spec, "x", 8, ("q_proj",), 1))
    with pytest.raises(ValueError, match="no arena rows given for the groups \\['down_proj'\\]"):
        bufs.write({"qkv_proj": 0}, adapter(spec, "x", 8, ("q_proj", "down_proj"), 1))


def test_an_adapter_sits_at_its_own_rows_in_each_group(tiny):
    """Each group's rows come from the slot pool separately: written at qkv_proj row 8
    and down_proj row 24, the adapter's weights are there and nowhere else, and its
    group ranks are what the pool reserves (0 for the groups it does not target)."""
    spec = load_model_spec(tiny.model_dir)
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    ad = adapter(spec, "a", 8, ("v_proj", "down_proj"), 5)
    assert bufs.group_ranks(ad) == {"qkv_proj": 8, "o_proj": 0, "gate_up_proj": 0, "down_proj": 8}
    bufs.write({"qkv_proj": 8, "down_proj": 24}, ad)
    for layer, groups in enumerate(bufs.layers):
        qkv, down = groups["qkv_proj"], groups["down_proj"]
        a, b = ad.weights[(layer, "v_proj")]
        c0, c1 = qkv.slice_offsets[2], qkv.slice_offsets[3]
        assert torch.equal(qkv.a[2, 8:16], a) and torch.equal(qkv.b[c0:c1, 8:16], b)
        assert not qkv.a[:, :8].any() and not qkv.a[:, 16:].any() and not qkv.a[:2, 8:16].any()
        a, b = ad.weights[(layer, "down_proj")]
        assert torch.equal(down.a[0, 24:32], a) and torch.equal(down.b[:, 24:32], b)
        assert not down.a[:, :24].any() and not down.b[:, :24].any()
        assert not groups["o_proj"].a.any() and not groups["gate_up_proj"].b.any()


def test_a_handed_over_slot_is_written_layer_by_layer_behind_the_step(tiny):
    """A load into a slot the running step still reads writes layer i only once the step
    has finished layer i (StepProgress), and every layer once the step is over."""
    spec = load_model_spec(tiny.model_dir)
    assert spec.num_layers >= 2
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    bufs.write(16, adapter(spec, "old", 8, ("q_proj",), 3))
    before = [layer["qkv_proj"].a[0, 16:24].clone() for layer in bufs.layers]
    progress = StepProgress(torch.device("cpu"), timeout_s=30)
    load = threading.Thread(
        target=bufs.write, args=(16, adapter(spec, "new", 8, ("q_proj",), 4), progress)
    )
    load.start()

    def written(layer: int) -> bool:
        return not torch.equal(bufs.layers[layer]["qkv_proj"].a[0, 16:24], before[layer])

    time.sleep(0.2)
    assert not written(0), "layer 0 written before the step finished it"
    progress.layer_done(0)
    for _ in range(200):  # bounded: the loader needs a moment to wake up
        if written(0):
            break
        time.sleep(0.01)
    assert written(0)
    assert not written(1), "layer 1 written before the step finished it"
    progress.finish()  # the step ended (or failed): nothing holds the load back any more
    load.join(10)
    assert not load.is_alive() and all(written(i) for i in range(spec.num_layers))


def test_adapters_in_half_precision_files_load_into_fp32_slots(tiny):
    """PEFT files are often bf16 or fp16 and the conversion keeps their dtype; a CPU
    engine's fp32 slots hold them widened exactly (numpy has no bfloat16)."""
    spec = load_model_spec(tiny.model_dir)
    modules = ("q_proj", "down_proj")
    for dtype in (torch.bfloat16, torch.float16):
        src = adapter(spec, "half", 8, modules, 4)
        src.weights = {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in src.weights.items()}
        bufs = LoRASlotBuffers(spec, 2, 16, torch.device("cpu"), torch.float32)
        bufs.write(8, src)
        for layer in range(spec.num_layers):
            a, b = src.weights[(layer, "q_proj")]
            qkv = bufs.layers[layer]["qkv_proj"]
            assert torch.equal(qkv.a[0, 8:16], a.float())
            assert torch.equal(qkv.b[: b.shape[0], 8:16], b.float())


def test_modules_are_held_at_their_own_rank_and_a_group_computes_its_largest(tiny):
    """rank_pattern: each module's rows are its own rank's, a group's rank is its largest
    module's (what the kernels compute), and the rows a group reads beyond a module's own
    rank are zeros even where another adapter held them before."""
    spec = load_model_spec(tiny.model_dir)
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    bufs = LoRASlotBuffers(spec, 2, 16, torch.device("cpu"), torch.float32)
    bufs.write(0, adapter(spec, "before", 16, all_modules, 0))
    q, v, down = (adapter(spec, n, r, (m,), s) for n, r, m, s in [
        ("q", 16, "q_proj", 1), ("v", 4, "v_proj", 2), ("down", 8, "down_proj", 3)
    ])  # fmt: skip
    weights = q.weights | v.weights | down.weights
    mixed = LoRAAdapterWeights("mixed", 16, 1.0, ("q_proj", "v_proj", "down_proj"), weights)
    bufs.write(0, mixed)
    bufs.activate(1, 0, mixed)
    assert {g: r[1] for g, r in bufs.table.ranks.items()} == {
        "qkv_proj": 16, "o_proj": 0, "gate_up_proj": 0, "down_proj": 8,
    }  # fmt: skip
    for layer, groups in enumerate(bufs.layers):
        qkv = groups["qkv_proj"]
        (q0, q1), (k0, k1), (v0, v1) = (qkv.slice_offsets[j : j + 2] for j in range(3))
        a, b = weights[(layer, "q_proj")]
        assert torch.equal(qkv.a[0, :16], a) and torch.equal(qkv.b[q0:q1, :16], b)
        assert not qkv.a[1, :16].any() and not qkv.b[k0:k1, :16].any()
        a, b = weights[(layer, "v_proj")]
        assert torch.equal(qkv.a[2, :4], a) and torch.equal(qkv.b[v0:v1, :4], b)
        assert not qkv.a[2, 4:16].any() and not qkv.b[v0:v1, 4:16].any()
        a, b = weights[(layer, "down_proj")]
        assert torch.equal(groups["down_proj"].a[0, :8], a)


def test_a_layer_an_adapter_skips_reads_zeros_not_the_previous_occupant(tiny):
    """layers_to_transform: the group's rank rows are read in every layer, so a layer the
    adapter has no weights for must hold zeros there, not the rows' previous adapter."""
    spec = load_model_spec(tiny.model_dir)
    bufs = LoRASlotBuffers(spec, 2, 8, torch.device("cpu"), torch.float32)
    bufs.write(0, adapter(spec, "before", 8, ("q_proj", "down_proj"), 0))
    full = adapter(spec, "later", 8, ("q_proj",), 1)
    last = spec.num_layers - 1
    only_last = {k: w for k, w in full.weights.items() if k[0] == last}
    bufs.write(0, LoRAAdapterWeights("later", 8, 1.0, ("q_proj",), only_last))
    for layer, groups in enumerate(bufs.layers):
        qkv = groups["qkv_proj"]
        if layer == last:
            assert torch.equal(qkv.a[0, :8], full.weights[(layer, "q_proj")][0])
        else:
            assert not qkv.a[:, :8].any() and not qkv.b[:, :8].any()


def test_slot_tensors_send_each_table_version_once_and_a_hand_over_view_too(tiny):
    """SlotTensors compares versions, not values: every activate/clear is a new version
    and is sent; a view taken before a hand-over cleared a slot is its own (older)
    version, sent for the one step that runs with it, then the live table again."""
    spec = load_model_spec(tiny.model_dir)
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    tensors = SlotTensors(bufs.num_slots, torch.device("cpu"), bufs.groups)
    tensors.update(bufs.table)
    tensors.update(bufs.table)
    assert tensors.uploads == 1
    bufs.activate(2, {"qkv_proj": 8}, adapter(spec, "a", 8, ("q_proj",), 1))
    view = bufs.view()
    tensors.update(bufs.table)
    tensors.update(view)  # the same version: nothing to send
    assert tensors.uploads == 2 and tensors.offsets["qkv_proj"][2] == 8
    bufs.clear(2)  # a hand-over: the running step still runs with `view`
    tensors.update(view)
    assert tensors.uploads == 2 and tensors.ranks["qkv_proj"][2] == 8
    tensors.update(bufs.table)
    assert tensors.uploads == 3 and tensors.ranks["qkv_proj"][2] == 0
    tensors.update(view)
    assert tensors.uploads == 4 and tensors.ranks["qkv_proj"][2] == 8


class _Copies(TorchDispatchMode):
    """Records every copy into a non-CPU tensor: (source, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].device.type != "cpu":
            self.copies.append((args[1], bool(args[2]) if len(args) > 2 else False))
        return func(*args, **(kwargs or {}))


def test_a_write_to_a_device_copies_from_pinned_memory_without_blocking(tiny, monkeypatch):
    """On a device (meta here: a stand-in that keeps no values), each of A's and B's rows
    is one non_blocking copy from the host cache's pinned staging, contiguous as staged:
    a transposed source would make torch copy it to pageable memory and wait."""
    buffers: list[torch.Tensor] = []

    def pinned_buffer(nbytes: int) -> torch.Tensor:
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    monkeypatch.setattr(dev, "pinning", lambda: True)
    monkeypatch.setattr(dev, "host_buffer", pinned_buffer)
    spec = load_model_spec(tiny.model_dir)
    modules = ("q_proj", "v_proj", "down_proj")
    source = {"a": adapter(spec, "a", 8, modules, 3)}
    staged = HostCache(SimpleNamespace(fetch=source.get), 1 << 30).get("a")
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("meta"), torch.float32)
    with _Copies() as mode:
        bufs.write(16, staged)
    spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers]
    assert len(mode.copies) == 2 * len(staged.weights)
    for src, non_blocking in mode.copies:
        assert non_blocking and src.is_contiguous()
        assert any(lo <= src.data_ptr() and src.data_ptr() + src.nbytes <= hi for lo, hi in spans)


def test_a_write_on_cpu_is_unchanged_by_staging(tiny):
    """The host cache on CPU hands the source's tensors through: the arenas get them."""
    spec = load_model_spec(tiny.model_dir)
    ad = adapter(spec, "a", 8, ("k_proj",), 4)
    staged = HostCache(SimpleNamespace(fetch=lambda _: ad), 1 << 30).get("a")
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    bufs.write(8, staged)
    for layer, groups in enumerate(bufs.layers):
        qkv = groups["qkv_proj"]
        c0, c1 = qkv.slice_offsets[1], qkv.slice_offsets[2]
        a, b = ad.weights[(layer, "k_proj")]
        assert torch.equal(qkv.a[1, 8:16], a) and torch.equal(qkv.b[c0:c1, 8:16], b)
