"""gpt-oss against the outside oracle: transformers (eager) + PEFT, fp32.

The tiny model (cluster/demo/families.py "gptoss") has every quirk biting: sinks near a
prompt's log-sum-exp, q/k/v/o and router and expert biases drawn non-zero, a window of 8
on layer 0 (prompts of 5 and 40 tokens, 16-token chunked prefill), layer 1 full, yarn
over a 64-token original context, the clamped SwiGLU at limit 1.5 and alpha 1.5, the
experts stacked with gate and up interleaved. Its MXFP4 form (the experts as the Hub
ships them, `*_blocks` / `*_scales` with quant_method mxfp4) is checked against
transformers loading the same files. Adapters are written by peft: attention only,
experts only (target_parameters), and both.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from kernels.quant_formats import Mxfp4Weight
from replica.executor.memory_plan import weight_bytes
from replica.model.peft_config import AdapterFormatError
from replica.model.spec import ModelConfigError, spec_from_dict
from replica.wire import SamplingParams
from tests.engines import held_bytes
from tests.oracle import ATTENTION, check_mixed_batch, hf_logits, hf_model, peft_adapter
from tests.quant_checkpoints import GPT_OSS_20B, mxfp4_copy
from tests.replica.model.families import (
    MARGIN,
    NEW_TOKENS,
    check_base_unchanged_beside_adapters,
    engine_for,
    prompts,
    router_margin,
)

EXPERTS = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(model dir, its MXFP4 copy, {name: peft adapter}) built once for the module."""
    model_dir = family_model_dir("gptoss")
    root = tmp_path_factory.mktemp("gptoss")
    adapters = {
        "attn": peft_adapter(model_dir, root / "attn", ATTENTION, r=8, alpha=16, seed=1),
        "experts": peft_adapter(
            model_dir, root / "experts", [], r=4, alpha=8, seed=3, **EXPERTS
        ),  # fmt: skip
        "all": peft_adapter(
            model_dir,
            root / "all",
            ATTENTION,
            r=16,
            alpha=8,
            seed=2,
            rank_pattern={"layers.0.mlp.experts.down_proj": 4},
            **EXPERTS,
        ),  # fmt: skip
    }
    return model_dir, mxfp4_copy(model_dir, root / "mxfp4"), adapters


def test_gpt_oss_matches_transformers_and_peft_in_one_mixed_batch(gpt_oss):
    """Sinks, windows, biases, clamped SwiGLU and yarn: logits of every position within
    2e-4 and greedy tokens of one mixed batch equal transformers + PEFT; each adapter
    (one on attention only, one on the experts only) changes the continuation. (The
    adapter on both is checked against TP=1 in test_tensor_parallel.py, and in the
    batches of the test of sixteen adapters below.)"""
    model_dir, _, every = gpt_oss
    adapters = {name: every[name] for name in ("attn", "experts")}
    eng = engine_for(model_dir, adapters, lora_experts=True)
    ps = prompts(eng.spec.vocab_size)
    assert eng.spec.window(0) == 8 < len(ps[1]) and eng.spec.window(1) is None
    for adapter in (None, *adapters.values()):
        ref = hf_model(model_dir, adapter, eager=True)
        for p in ps:
            assert router_margin(ref, p, eng.spec.num_experts_per_tok) > MARGIN, adapter
    got = check_mixed_batch(eng, model_dir, adapters, ps, NEW_TOKENS)
    for name in adapters:
        assert got[name] != got[None], f"{name}: the adapter should change the continuation"


def test_each_quirk_bites(gpt_oss):
    """Serving without any one of the sinks, the o_proj and expert biases, the clamp or
    yarn changes the logits by far more than the oracle's tolerance: the test above
    checks each of them."""
    from dataclasses import replace

    from replica.model.decoder import gated_activation
    from replica.model.spec import RopeSpec

    model_dir, _, _ = gpt_oss
    eng = engine_for(model_dir, {})
    p = prompts(eng.spec.vocab_size)[1]
    want = eng.score(p)
    model, spec = eng.executor.model, eng.spec
    plain_rope = model._rope(RopeSpec(spec.rope_theta, None))
    changes = {
        "sinks": lambda layer: setattr(layer, "sinks", None),
        "o_proj bias": lambda layer: setattr(layer.o_proj, "bias", None),
        "expert biases": lambda layer: setattr(layer.mlp, "gate_up_bias", None),
        "clamp": lambda layer: setattr(
            layer.mlp, "glu", gated_activation(replace(spec, swiglu_limit=100.0))
        ),
        "yarn": lambda layer: setattr(layer, "rope", plain_rope),
    }
    ropes = model.ropes
    for quirk, change in changes.items():
        saved = [(dict(vars(layer)), dict(vars(layer.o_proj)), dict(vars(layer.mlp)))
                 for layer in model.layers]  # fmt: skip
        for layer in model.layers:
            change(layer)
        model.ropes = [plain_rope] if quirk == "yarn" else ropes
        assert (eng.score(p) - want).abs().max() > 0.05, quirk
        for layer, (attrs, o_attrs, mlp_attrs) in zip(model.layers, saved):
            vars(layer).update(attrs)
            vars(layer.o_proj).update(o_attrs)
            vars(layer.mlp).update(mlp_attrs)
        model.ropes = ropes
        assert torch.equal(eng.score(p), want)


def test_mxfp4_checkpoint_equals_transformers_loading_the_same_files(gpt_oss):
    """The Hub's layout: experts as MXFP4 blocks and scales, quantization_config mxfp4.
    Held packed (the bytes the memory plan counts), the base and an expert adapter equal
    transformers (which dequantizes them) + PEFT; the quantization really changed the
    model."""
    model_dir, mx_dir, adapters = gpt_oss
    eng = engine_for(mx_dir, {"experts": adapters["experts"]}, lora_experts=True)
    model = eng.executor.model
    assert all(isinstance(w, Mxfp4Weight) for w in model.layers[0].mlp.packed)
    assert held_bytes(model) == weight_bytes(eng.spec, 1, eng.dtype)
    refs = {None: hf_model(mx_dir, eager=True),
            "experts": hf_model(mx_dir, adapters["experts"], eager=True)}  # fmt: skip
    assert type(refs[None].model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    unquantized = hf_model(model_dir, eager=True)
    for p in prompts(eng.spec.vocab_size):
        for name, ref in refs.items():
            assert router_margin(ref, p, eng.spec.num_experts_per_tok) > MARGIN
            diff = (eng.score(p, name) - hf_logits(ref, p)).abs().max().item()
            assert diff < 2e-4, f"{name}: max |logit diff| {diff}"
        assert (eng.score(p) - hf_logits(unquantized, p)).abs().max() > 0.1
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = eng.generate([(p, greedy, a) for p in prompts(256) for a in refs])
    from tests.oracle import hf_greedy

    want = [hf_greedy(refs[a], p, NEW_TOKENS) for p in prompts(256) for a in refs]
    assert [s.output_ids for s in outputs] == want


def test_base_requests_are_unchanged_by_sixteen_adapters_beside_them(gpt_oss):
    model_dir, _, adapters = gpt_oss
    check_base_unchanged_beside_adapters(model_dir, adapters, lora_experts=True)


def test_router_lora_is_refused_by_name(gpt_oss, tmp_path):
    """This server does not serve LoRA on the router: PEFT's target_parameters on its
    weight is refused naming the parameter, and a router LoRA tensor in an adapter file
    naming the tensor, never loaded without it."""
    from replica.model.adapter_weights import load_peft_adapter
    from replica.model.spec import load_model_spec

    model_dir, _, adapters = gpt_oss
    spec = load_model_spec(model_dir)
    path = peft_adapter(model_dir, tmp_path / "router", ["q_proj"], r=4, alpha=8, seed=4,
                        target_parameters=["mlp.router.weight"])  # fmt: skip
    with pytest.raises(AdapterFormatError, match=r"mlp\.router\.weight"):
        load_peft_adapter(path, spec, 64)
    by_hand = tmp_path / "by-hand"
    shutil.copytree(adapters["attn"], by_hand)
    tensors = load_file(by_hand / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.router.lora_A.weight"
    tensors[key] = torch.zeros(8, spec.hidden_size)
    tensors[key.replace("lora_A", "lora_B")] = torch.zeros(spec.num_experts, 8)
    save_file(tensors, by_hand / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match=r"layers\.1\.mlp\.router\.lora_"):
        load_peft_adapter(by_hand, spec, 64)


def test_hub_config_reads_as_transformers_fills_it_in():
    from transformers import GptOssConfig

    s = spec_from_dict(GPT_OSS_20B)
    hf = GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    assert s.layer_types == tuple(hf.layer_types) and s.sliding_window == 128
    assert s.window(0) == 128 and s.window(1) is None
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (32, 4, 2880)
    assert s.swiglu_limit == hf.swiglu_limit and s.swiglu_alpha == hf.swiglu_alpha
    assert s.qkv_bias and s.o_bias and s.attn_sinks and s.moe_bias
    assert s.rope_theta == 150_000 and s.rope_scaling["rope_type"] == "yarn"
    assert s.rope_scaling["truncate"] is False and s.rope_scaling["factor"] == 32.0
    assert (s.q_size, s.kv_size) == (4096, 512)


def test_mxfp4_is_accepted_for_gpt_oss_only():
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
             "quantization_config": {"quant_method": "mxfp4"}}  # fmt: skip
    with pytest.raises(ModelConfigError, match="quant_method='mxfp4'"):
        spec_from_dict(llama)
    with pytest.raises(ModelConfigError, match="quant_method='fp8'"):
        spec_from_dict({**GPT_OSS_20B, "quantization_config": {"quant_method": "fp8"}})


def test_mxfp4_blocks_of_the_wrong_dtype_are_refused_by_name(gpt_oss, tmp_path):
    from replica.model.weights import WeightLoadError

    _, mx_dir, _ = gpt_oss
    bad = tmp_path / "bad"
    shutil.copytree(mx_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    key = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key].to(torch.int16)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=key):
        engine_for(bad, {})


@pytest.mark.slow  # the Triton interpreter: about 30 s on 2 shared CPU cores
def test_triton_kernels_give_the_torch_path_output(gpt_oss):
    """The model end to end with the Triton kernels forced (the interpreter here): sinks
    in the decode and prefill kernels, the grouped expert GEMMs and expert LoRA."""
    import kernels

    model_dir, _, adapters = gpt_oss
    eng = engine_for(model_dir, {"experts": adapters["experts"]}, lora_experts=True)
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    p = prompts(eng.spec.vocab_size)[1][:12]  # past the window of 8
    requests = [(p, sampling, "experts"), (p[:5], sampling, None)]
    with kernels.forced_backend("torch"):
        want = [s.output_ids for s in eng.generate(requests)]
        want_logits = eng.score(p, "experts")
    with kernels.forced_backend("triton"):
        got = [s.output_ids for s in eng.generate(requests)]
        got_logits = eng.score(p, "experts")
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def group_straddling_mxfp4(root: Path) -> tuple[Path, Path]:
    """The tiny gpt-oss with experts of 96 columns, and its MXFP4 copy: at tp 2 a rank
    owns 48 of them, at tp 4 24, so every split starts or ends inside a group of 32."""
    dense = family_model_dir("gptoss", overrides={"intermediate_size": 96})
    return dense, mxfp4_copy(dense, root)


def borrowed(shard) -> torch.Tensor:
    """[held columns] bool: the columns `shard`'s rank holds and does not own."""
    (lo, hi), (h0, h1) = shard.expert_range, shard.expert_held_range
    mask = torch.ones(h1 - h0, dtype=torch.bool)
    mask[lo - h0 : hi - h0] = False
    return mask


def test_mxfp4_experts_cut_inside_a_group_sum_to_the_unsplit_layer(tmp_path):
    """Each rank holds the whole groups its expert columns start and end in (at tp 4:
    32, 64, 64 and 32 columns), their gate/up rows and biases zero for the columns it
    borrows: the ranks' partial expert sums (the all-reduce's inputs) add up to the
    unsplit layer's output, every rank holds at most what the plan counts and the widest
    exactly that, and the widest rank's adapter arenas are the plan's."""
    from kernels import make_segment_info
    from replica.config import EngineConfig
    from replica.executor.memory_plan import plan_memory
    from replica.model.decoder import CausalLM
    from replica.model.lora_slots import LoRASlotBuffers
    from replica.model.spec import load_model_spec
    from replica.model.tp_layers import TPRank
    from replica.model.tp_shard import TPShard

    _, model_dir = group_straddling_mxfp4(tmp_path / "mx")
    spec, dtype = load_model_spec(model_dir), torch.float32
    x = torch.randn(9, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    seg = {"qkv_proj": make_segment_info([9], [0], [0], [1.0], [0])}  # base rows only
    unsplit = CausalLM(model_dir, spec=spec)
    whole = [layer.mlp(x, seg) for layer in unsplit.layers]
    whole_gate = unsplit.layers[0].mlp.packed[0].dequantize_rows(0, 96, 0)  # expert 0's
    held_cols = {2: [(0, 64), (32, 96)], 4: [(0, 32), (0, 64), (32, 96), (64, 96)]}
    for tp, cols in held_cols.items():
        shards = [TPShard(spec, rank, tp) for rank in range(tp)]
        assert [shard.expert_held_range for shard in shards] == cols
        parts, held, arenas = [], [], []
        for shard in shards:
            model = CausalLM(model_dir, spec=spec, tp=TPRank(shard, None))
            (lo, hi), (h0, h1) = shard.expert_range, shard.expert_held_range
            own, mlp = slice(lo - h0, hi - h0), model.layers[0].mlp
            gate = mlp.packed[0].dequantize_rows(0, h1 - h0, 0)
            assert torch.equal(gate[own], whole_gate[lo:hi])
            assert not gate[borrowed(shard)].any(), "borrowed columns' gate rows are zero"
            bias = mlp.gate_up_bias.view(spec.num_experts, 2, h1 - h0)  # gate, up
            assert not bias[:, :, borrowed(shard)].any(), "and their biases"
            parts.append([layer.mlp(x, seg) for layer in model.layers])
            held.append(held_bytes(model))
            lora = LoRASlotBuffers(spec, 3, 16, "cpu", dtype, shard.lora_shapes, experts=True)
            arenas.append(lora.nbytes())
        for layer, want in enumerate(whole):
            got = sum(part[layer] for part in parts)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert max(held) == weight_bytes(spec, tp, dtype), tp
        config = EngineConfig(model=str(model_dir), max_lora_rank=16, tp_size=tp,
                              kv_cache_bytes=1 << 20, adapters={"num_slots": 3},
                              lora_experts=True)  # fmt: skip
        assert max(arenas) == plan_memory(spec, config, dtype, 1 << 40).adapter_memory_bytes
    assert held[0] < held[1], "at tp 4 rank 0 holds one group, rank 1 two"


def test_expert_lora_of_borrowed_columns_is_zero_on_the_rank(tmp_path):
    """A rank's expert LoRA over its held columns: gate/up B rows and down A columns of
    the columns it borrows zero, the rest its share of the adapter's, from the adapter
    file and from the object store's numpy arrays alike, in the arenas' shapes."""
    from replica.adapters.packing import pack_adapter, unpack_adapter
    from replica.model.adapter_weights import load_peft_adapter
    from replica.model.spec import load_model_spec
    from replica.model.tp_shard import TPShard

    dense, model_dir = group_straddling_mxfp4(tmp_path / "mx")
    spec = load_model_spec(model_dir)
    path = peft_adapter(dense, tmp_path / "experts", [], r=4, alpha=8, seed=3, **EXPERTS)
    whole = load_peft_adapter(path, spec, 64, lora_experts=True)
    for rank in range(4):
        shard = TPShard(spec, rank, 4)
        (lo, hi), (h0, h1) = shard.expert_range, shard.expert_held_range
        own, lent = slice(lo - h0, hi - h0), borrowed(shard)
        mine = whole.select(shard.slice_lora)
        stored = unpack_adapter(pack_adapter(whole), None, shard.slice_lora).weights
        assert mine.weights.keys() == stored.keys()
        for (layer, module), (a, b) in mine.weights.items():
            assert all(map(torch.equal, (a, b), stored[layer, module]))
            in_f, out_f = shard.lora_shapes()[module]
            whole_a, whole_b = whole.weights[layer, module]
            if module == "expert_down_proj":
                assert a.shape[2] == in_f == h1 - h0
                assert torch.equal(a[:, :, own], whole_a[:, :, lo:hi])
                assert not a[:, :, lent].any(), "borrowed columns' A columns are zero"
            elif module in ("expert_gate_proj", "expert_up_proj"):
                assert b.shape[1] == out_f == h1 - h0
                assert torch.equal(b[:, own], whole_b[:, lo:hi])
                assert not b[:, lent].any(), "borrowed columns' B rows are zero"
