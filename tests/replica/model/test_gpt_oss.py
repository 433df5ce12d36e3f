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

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.demo.families import family_model_dir
from kernels.quant_formats import E2M1_VALUES, Mxfp4Weight
from replica.executor.memory_plan import weight_bytes
from replica.model.peft_config import AdapterFormatError
from replica.model.spec import ModelConfigError, spec_from_dict
from replica.wire import SamplingParams
from tests.engines import held_bytes
from tests.model_dirs import PUBLISHED
from tests.oracle import ATTENTION, check_mixed_batch, hf_logits, hf_model, peft_adapter
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


# config.json of openai/gpt-oss-20b as the Hub ships it (MXFP4 experts)
GPT_OSS_20B = json.loads((PUBLISHED / "gpt-oss-20b" / "config.json").read_text())


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


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] fp32 -> OCP MXFP4 as gpt-oss ships it: blocks [E, N, K/32, 16] uint8
    (element 2j in the low nibble) and e8m0 scales [E, N, K/32] uint8, each 32-group's
    exponent the smallest that fits its largest value in e2m1's 6, values rounded to the
    nearest e2m1."""
    e, n, k = w.shape
    groups = w.reshape(e, n, k // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    code |= ((scaled < 0) & (code > 0)).long() << 3
    pairs = code.to(torch.uint8).reshape(e, n, k // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exp + 127).to(torch.uint8)


def mxfp4_copy(model_dir: Path, out: Path) -> Path:
    """The model with its experts in the Hub's MXFP4 layout: gate_up_proj [E, H, 2I] as
    gate_up_proj_blocks / _scales over [E, 2I, H] (out, in), down_proj likewise; biases,
    attention and router unquantized, as in openai/gpt-oss-20b."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(tensors.pop(key).transpose(1, 2).contiguous())
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_20B["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


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
