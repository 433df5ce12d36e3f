"""Tensor-parallel sharding arithmetic: every rank's parts put back together give the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.adapters.packing import pack_adapter, unpack_adapter
from replica.model.adapter_weights import load_peft_adapter
from replica.model.layout import CheckpointLayout
from replica.model.spec import ModelConfigError, load_model_spec, spec_from_dict
from replica.model.tp_shard import COLUMN_PARALLEL, ROW_PARALLEL, TPShard
from replica.model.weights import Checkpoint
from tests.conftest import tiny_assets


def spec(heads: int = 8, kv_heads: int = 2, **kw):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": 301, **kw}  # fmt: skip
    return spec_from_dict(cfg)


def shards(s, n: int) -> list[TPShard]:
    return [TPShard(s, r, n) for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_column_parallel_rows_split_or_replicate_kv_heads(n):
    s = spec(heads=8, kv_heads=2)
    for module in ("q_proj", "gate_proj", "up_proj", "k_proj", "v_proj"):
        ranges = [sh.out_range(module) for sh in shards(s, n)]
        whole = s.module_shapes()[module][1]
        if module in ("k_proj", "v_proj") and n > s.num_kv_heads:
            assert all(b - a == s.head_dim for a, b in ranges)  # one replicated KV head each
            continue
        assert ranges[0][0] == 0 and ranges[-1][1] == whole
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
    group = s.num_heads // s.num_kv_heads  # query heads per KV head
    for sh in shards(s, n):  # every rank's query heads attend with the KV heads it holds
        q0, q1 = sh.out_range("q_proj")
        k0, k1 = sh.out_range("k_proj")
        heads = range(q0 // s.head_dim, q1 // s.head_dim)
        assert {h // group for h in heads} == set(range(k0 // s.head_dim, k1 // s.head_dim))
        assert sh.local_spec.num_heads % sh.local_spec.num_kv_heads == 0


@pytest.mark.parametrize("n", [2, 4])
def test_lora_shards_compute_the_whole_delta(n):
    """S-LoRA: column layers (A whole, B by rows) concatenate; row layers (A by columns)
    sum the [T, r] intermediate, then each rank's B rows give its output columns."""
    s = spec(heads=8, kv_heads=8)
    g = torch.Generator().manual_seed(0)
    r, t = 4, 5
    for module, (in_f, out_f) in s.module_shapes().items():
        a, b = torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)
        x = torch.randn(t, in_f, generator=g)
        whole = x @ a.T @ b.T
        parts = []
        if module in COLUMN_PARALLEL:
            for sh in shards(s, n):
                a_r, b_r = sh.slice_lora(module, a, b)
                assert a_r.shape == (r, sh.lora_shapes()[module][0])
                parts.append(x @ a_r.T @ b_r.T)
        else:
            inter = sum(
                x[:, slice(*sh.in_range(module))] @ sh.slice_lora(module, a, b)[0].T
                for sh in shards(s, n)
            )  # the all-reduce
            for sh in shards(s, n):
                b_r = sh.slice_lora(module, a, b)[1]
                assert b_r.shape == (sh.lora_shapes()[module][1], r)
                parts.append(inter @ b_r.T)
        assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-5), module
    assert set(COLUMN_PARALLEL) | set(ROW_PARALLEL) == set(s.module_shapes())


def test_a_model_the_ranks_cannot_split_is_refused_with_the_reason():
    with pytest.raises(ModelConfigError, match="num_attention_heads=6 is not a multiple of 4"):
        TPShard(spec(heads=6, kv_heads=2, hidden_size=96), 0, 4)
    with pytest.raises(ModelConfigError, match="num_key_value_heads=3"):
        TPShard(spec(heads=6, kv_heads=3, hidden_size=96), 0, 2)


def test_sharded_checkpoint_reads_each_ranks_part_and_pads_the_vocab():
    assets = tiny_assets("llama", vocab_size=511)
    s = load_model_spec(assets.model_dir)
    full = Checkpoint(assets.model_dir)
    for sh in shards(s, 2):
        layout = CheckpointLayout(full, s, sh)
        q0, q1 = sh.out_range("q_proj")
        q = layout.projection(0, "q_proj")
        assert torch.equal(q, full.get("model.layers.0.self_attn.q_proj.weight",
                                       (s.q_size, s.hidden_size))[q0:q1])  # fmt: skip
        i0, i1 = sh.in_range("down_proj")
        down = layout.projection(0, "down_proj")
        whole = full.get(
            "model.layers.0.mlp.down_proj.weight", (s.hidden_size, s.intermediate_size)
        )
        assert torch.equal(down, whole[:, i0:i1])
        norm = layout.norm(None, "norm.weight", s.hidden_size)
        assert torch.equal(norm, full.get("model.norm.weight", (s.hidden_size,)))
        v0, v1 = sh.vocab_range
        embed = layout.vocab(lm_head=False)
        whole = full.get("model.embed_tokens.weight", (s.vocab_size, s.hidden_size))
        assert embed.shape == (256, s.hidden_size)
        real = min(v1, s.vocab_size) - v0
        assert torch.equal(embed[:real], whole[v0 : v0 + real])
        assert not embed[real:].any()  # rank 1: one zero row of padding
    assert real == 255


def test_a_ranks_adapter_shard_is_a_copy_of_only_its_part(tiny):
    s = load_model_spec(tiny.model_dir)
    adapter = load_peft_adapter(tiny.adapters["adapter-00"], s, 64)
    payload = pack_adapter(adapter)
    for sh in shards(s, 2):
        from_disk = adapter.select(sh.slice_lora)
        from_store = unpack_adapter(payload, "adapter-00", sh.slice_lora)
        assert from_store.nbytes == from_disk.nbytes < adapter.nbytes
        for key, (a, b) in adapter.weights.items():
            want_a, want_b = sh.slice_lora(key[1], a, b)
            for got in (from_disk.weights[key], from_store.weights[key]):
                assert torch.equal(got[0], want_a) and torch.equal(got[1], want_b)
                assert got[0].is_contiguous() and got[1].is_contiguous()
                # its own memory: the whole adapter's tensors and arrays can be freed
                assert got[1].untyped_storage().nbytes() == got[1].nbytes
        layer, module = next(k for k in adapter.weights if k[1] == "o_proj")
        arrays = payload["weights"][f"{layer}.{module}"]
        assert not np.shares_memory(from_store.weights[(layer, module)][0].numpy(), arrays[0])


def test_a_load_time_cut_through_a_quantization_group_is_refused_saying_what_to_change():
    """The load's own check (the plan refuses most such splits first, but not every layout:
    Gemma 4's per-expert packed experts reach it): it names the cut and asks for a split
    that keeps groups whole, without claiming the plan refused it."""
    from kernels.quant_pack import quantize_fp8
    from replica.model.quant_weights import slice_cols, slice_rows
    from replica.model.weights import WeightLoadError

    w = quantize_fp8(torch.randn(256, 256), (128, 128))
    assert slice_rows(w, 128, 256).weight.shape == (128, 256)  # whole blocks: served
    for cut in (lambda: slice_rows(w, 0, 64), lambda: slice_cols(w, 64, 256)):
        with pytest.raises(WeightLoadError) as e:
            cut()
        message = str(e.value)
        assert "cut FP8 scale blocks of 128" in message and "plan" not in message
        assert "keep every quantization group whole" in message
