"""The host cache: an LRU of staged adapters whose host memory, counted as the pinned
allocator holds it, stays within its budget at every moment."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from replica import device as dev
from replica.adapters.host_cache import HostCache
from replica.model.adapter_weights import LoRAAdapterWeights

MIB = 1 << 20


def adapter(name: str, *sizes: int) -> LoRAAdapterWeights:
    """An adapter of one module per layer whose (A, B) are float32 tensors of `sizes`
    bytes each (A) and a quarter of that (B)."""
    weights = {}
    for layer, size in enumerate(sizes):
        a = torch.full((4, size // 16), float(layer))
        weights[(layer, "q_proj")] = (a, torch.full((size // 16, 1), -float(layer)))
    return LoRAAdapterWeights(name, 4, 1.0, ("q_proj",), weights)


class Source:
    def __init__(self, adapters: dict[str, LoRAAdapterWeights]) -> None:
        self.adapters, self.fetches = adapters, 0

    def fetch(self, name: str) -> LoRAAdapterWeights:
        self.fetches += 1
        return self.adapters[name]


class PinnedMemory:
    """host_buffer as the CUDA build's: each block held at the allocator's power of two,
    counted while any view of it lives; the peak of what was live is kept."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.requests: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        held = dev.host_block_bytes(nbytes)
        self.requests.append(nbytes)
        self.live += held
        self.peak = max(self.peak, self.live)
        block = np.empty(held, dtype=np.uint8)
        weakref.finalize(block, self._freed, held)  # the tensor's views keep the array alive
        return torch.from_numpy(block)[:nbytes]

    def _freed(self, held: int) -> None:
        self.live -= held


@pytest.fixture
def pinned(monkeypatch) -> PinnedMemory:
    memory = PinnedMemory()
    monkeypatch.setattr(dev, "pinning", lambda: True)
    monkeypatch.setattr(dev, "host_buffer", memory)
    return memory


def test_pinned_memory_stays_within_the_budget_at_every_moment(pinned):
    """Adapters of 1.25-11 MiB (chunks of 4 MiB; a 9 MiB tensor in a 16 MiB block of its
    own) through a 24 MiB budget: room is made before each copy is allocated, so what is
    pinned never exceeds the budget, counted as the allocator rounds it."""
    adapters = {
        "small": adapter("small", MIB),  # 1.25 MiB: one chunk
        "mid": adapter("mid", 3 * MIB, 3 * MIB),  # 7.5 MiB: two chunks
        "big": adapter("big", 9 * MIB),  # a 9 MiB A: 16 MiB of its own, and a chunk for B
        "wide": adapter("wide", 2 * MIB, 2 * MIB, 2 * MIB, 2 * MIB),  # 10 MiB: three chunks
    }
    source = Source(adapters)
    cache = HostCache(source, 24 * MIB)
    for name in ["small", "mid", "big", "mid", "wide", "small", "big", "wide", "mid"]:
        got = cache.get(name)
        want = adapters[name].weights
        assert got.weights.keys() == want.keys()
        assert all(torch.equal(x, y) for k in want for x, y in zip(got.weights[k], want[k]))
        del got  # a load lets go of its adapter once copied: then only the cache holds it
        assert cache.held_bytes == pinned.live <= cache.budget, name
    assert pinned.peak <= cache.budget
    assert set(pinned.requests) == {dev.PINNED_CHUNK_BYTES, 9 * MIB}


def test_a_hit_touches_the_lru_and_costs_no_copy(pinned):
    source = Source({n: adapter(n, 3 * MIB) for n in "abcd"})  # 3.75 MiB: one chunk each
    cache = HostCache(source, 3 * dev.PINNED_CHUNK_BYTES)
    cache.get("a"), cache.get("b"), cache.get("c")
    assert cache.get("a") is cache.get("a") and source.fetches == 3
    cache.get("d")  # evicts b, the least recently used
    assert cache.names() == ["c", "a", "d"] and len(pinned.requests) == 4
    cache.drop("a")
    assert cache.held_bytes == pinned.live == 2 * dev.PINNED_CHUNK_BYTES


def test_an_adapter_larger_than_the_budget_is_served_unstaged(pinned):
    big = adapter("big", 8 * MIB)
    cache = HostCache(Source({"big": big, "small": adapter("small", MIB)}), 8 * MIB)
    cache.get("small")
    assert cache.get("big") is big  # the source's copy: nothing pinned, nothing evicted
    assert cache.names() == ["small"] and pinned.live == dev.PINNED_CHUNK_BYTES


def test_on_cpu_the_budget_counts_the_tensors_bytes_and_nothing_is_copied():
    adapters = {n: adapter(n, 1024) for n in "abc"}  # 1280 bytes each
    cache = HostCache(Source(adapters), 2600)
    got, want = cache.get("a").weights, adapters["a"].weights
    assert all(x is y for k in want for x, y in zip(got[k], want[k]))
    cache.get("b"), cache.get("c")
    assert cache.names() == ["b", "c"] and cache.held_bytes == 2560
    assert HostCache(Source(adapters), 0).get("a") is adapters["a"]  # no budget: no cache


def test_a_registration_put_replaces_its_copy_within_the_budget(pinned):
    cache = HostCache(Source({}), 2 * dev.PINNED_CHUNK_BYTES)
    cache.put("a", adapter("a", 3 * MIB))
    cache.put("b", adapter("b", 3 * MIB))
    new = cache.put("a", adapter("a", MIB))  # registered again under other weights
    assert cache.peek("a") is new and cache.names() == ["b", "a"]
    assert cache.held_bytes == pinned.live == 2 * dev.PINNED_CHUNK_BYTES
