"""The KV cache holds one pool per layer that owns KV: shared layers alias their source's
pool, layers without KV hold none, and the byte count the memory plan uses agrees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replica.model.kv_cache import KVCache
from replica.model.spec import ModelConfigError, base_spec, spec_from_dict

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
}


def _spec(kv_sources: tuple[int | None, ...]):
    return dataclasses.replace(spec_from_dict(CONFIG), kv_sources=kv_sources)


def test_shared_layers_alias_their_source_and_linear_layers_hold_none():
    # layer 0 keeps no KV (linear attention), 1 and 2 own theirs, 3 reads layer 2's
    spec = _spec((None, 1, 2, 2))
    kv = KVCache(spec, num_blocks=3, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert spec.kv_layers == (1, 2)
    assert kv.k[0] is None and kv.v[0] is None
    assert kv.k[3] is kv.k[2] and kv.v[3] is kv.v[2] and kv.k[1] is not kv.k[2]
    allocated = sum(t.numel() * t.element_size() for t in kv.pools)
    assert allocated == 3 * KVCache.bytes_per_block(spec, 4, torch.float32)
    assert len(kv.pools) == 4  # k and v of the two owning layers


def test_copy_blocks_moves_every_owned_pool_once():
    spec = _spec((None, 1, 1, 3))
    kv = KVCache(spec, num_blocks=2, block_size=2, device=torch.device("cpu"), dtype=torch.float32)
    for i, pool in enumerate(kv.pools):
        pool[:, :2] = i + 1
    kv.copy_blocks([0], [1])
    for i, pool in enumerate(kv.pools):
        assert torch.equal(pool[:, 2:], torch.full_like(pool[:, 2:], i + 1))


@pytest.mark.parametrize("sources", [(0, 1, 2), (0, 2, 2, 3), (None, 0, 2, 3)])
def test_a_sharing_map_a_cache_cannot_hold_is_refused(sources):
    with pytest.raises(ModelConfigError, match="KV"):
        base_spec(dict(CONFIG), "config.json", kv_sources=sources)
