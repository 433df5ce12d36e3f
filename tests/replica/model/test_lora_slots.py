"""Slot buffers: a load leaves exactly the adapter's weights and zero padding behind,
whatever larger adapter held the slot before (loads zero only what is dirty)."""

from __future__ import annotations

import threading
import time

import torch

from replica.device import StepProgress
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


def snapshot(bufs: LoRASlotBuffers, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for groups in bufs.layers for b in groups.values() for t in (b.a, b.b)]


def test_a_load_after_a_larger_adapter_equals_a_load_into_a_fresh_slot(tiny):
    spec = load_model_spec(tiny.model_dir)
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    big = adapter(spec, "big", 16, all_modules, 0)
    mid = adapter(spec, "mid", 8, ("q_proj", "v_proj", "down_proj"), 1)
    small = adapter(spec, "small", 4, ("k_proj",), 2)
    used = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    for a in (big, mid, small, big, small):  # shrink, shrink, grow, shrink
        used.write(1, a)
        fresh = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
        fresh.write(1, a)
        for got, want in zip(snapshot(used, 1), snapshot(fresh, 1)):
            assert torch.equal(got, want)
    assert all(torch.count_nonzero(t) == 0 for t in snapshot(used, 2))  # neighbours untouched


def test_a_handed_over_slot_is_written_layer_by_layer_behind_the_step(tiny):
    """A load into a slot the running step still reads writes layer i only once the step
    has finished layer i (StepProgress), and every layer once the step is over."""
    spec = load_model_spec(tiny.model_dir)
    assert spec.num_layers >= 2
    bufs = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    bufs.write(1, adapter(spec, "old", 8, ("q_proj",), 3))
    before = [layer["qkv_proj"].a[1].clone() for layer in bufs.layers]
    progress = StepProgress(torch.device("cpu"), timeout_s=30)
    load = threading.Thread(
        target=bufs.write, args=(1, adapter(spec, "new", 8, ("q_proj",), 4), progress)
    )
    load.start()

    def written(layer: int) -> bool:
        return not torch.equal(bufs.layers[layer]["qkv_proj"].a[1], before[layer])

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
        bufs.write(1, src)
        for layer in range(spec.num_layers):
            a, b = src.weights[(layer, "q_proj")]
            qkv = bufs.layers[layer]["qkv_proj"]
            assert torch.equal(qkv.a[1, :8], a.float())
            assert torch.equal(qkv.b[1, : b.shape[0], :8], b.float())
