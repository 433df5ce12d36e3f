"""Slot buffers: a load leaves exactly the adapter's weights and zero padding behind,
whatever larger adapter held the slot before (loads zero only what is dirty)."""

from __future__ import annotations

import torch

from replica.adapter_format import LoRAAdapterWeights
from replica.lora_slots import LoRASlotBuffers
from replica.model_config import load_model_spec


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
