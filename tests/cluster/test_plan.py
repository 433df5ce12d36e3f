"""`lorafleet plan`: a replica's GPU memory from config.json alone, on this CPU machine; and
quantized checkpoints counted packed; the refusals of unserved quantized checkpoints on
every command's start path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cluster.demo.families import FAMILY_CONFIGS, family_model_dir
from replica.config import EngineConfig
from replica.executor.memory_plan import plan_memory
from replica.model.spec import load_model_spec
from tests.cluster.cli_runs import refused, run_cli
from tests.model_dirs import PUBLISHED, config_only, write_gguf_labelled_qwen3

GiB = 2**30
KEYS = ("weights_bytes_per_gpu", "activation_bytes", "graph_bytes", "adapter_memory_bytes",
        "kv_cache_bytes", "kv_cache_tokens", "max_model_len",
        "max_concurrency_at_max_model_len")  # fmt: skip


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name, tp",
    [("Llama-3.1-8B", 1), ("Llama-3.1-70B", 4), ("Qwen3-32B", 4), ("Qwen3-30B-A3B", 1),
     ("gpt-oss-20b", 1), ("gpt-oss-20b", 2), ("gpt-oss-120b", 4), ("gpt-oss-120b", 8)],
)  # fmt: skip
def test_plan_prints_the_memory_plan_as_json_last(capsys, name, tp):
    model = PUBLISHED / name
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "80GiB", "--tp", str(tp))
    assert set(KEYS) <= set(got)
    config = EngineConfig(model=str(model), device="cuda", tp_size=tp)
    expected = plan_memory(load_model_spec(model), config, torch.bfloat16, 80 * GiB).to_json()
    assert {k: got[k] for k in KEYS} == {k: expected[k] for k in KEYS}
    assert got["checkpoint_bytes"] is None  # no index beside these configs


def test_gpt_oss_20b_plans_its_mxfp4_experts_packed(capsys):
    """The Hub's gpt-oss-20b is 13.8 GB of files (MXFP4 experts, the rest bf16): its plan
    holds about that, not the 39 GiB of experts dequantized."""
    model = str(PUBLISHED / "gpt-oss-20b")
    got = plan_json(capsys, "--model", model, "--gpu-memory", "80GiB")
    assert 12 * GiB < got["weights_bytes_per_gpu"] < 13 * GiB
    _, out, _ = run_cli(capsys, "plan", "--model", model, "--gpu-memory", "80GiB")
    assert "experts packed (mxfp4)" in out


def test_gpt_oss_120b_plans_at_4_and_8_ranks_each_holding_whole_mxfp4_groups(capsys):
    """tp 4 and 8, gpt-oss-120b's usual H100 deployments: its experts' 2880 columns split
    at 720 and 360, inside MXFP4 groups of 32, so a rank holds 736 or 384 of them (the
    groups its columns start and end in). It plans, each rank holding under half (a
    quarter) of tp 2's weights plus the replicated rest, and its KV cache grows."""
    model = str(PUBLISHED / "gpt-oss-120b")
    plans = {tp: plan_json(capsys, "--model", model, "--gpu-memory", "80GiB", "--tp", str(tp))
             for tp in (2, 4, 8)}  # fmt: skip
    weights = {tp: plan["weights_bytes_per_gpu"] for tp, plan in plans.items()}
    assert weights[2] / 2 < weights[4] < weights[2] / 2 * 1.05
    assert weights[4] / 2 < weights[8] < weights[4] / 2 * 1.1
    assert plans[2]["kv_cache_tokens"] < plans[4]["kv_cache_tokens"] < plans[8]["kv_cache_tokens"]


def test_plan_refuses_llama_70b_on_one_80gib_gpu_in_one_line(capsys):
    line = refused(capsys, "plan", "--model", str(PUBLISHED / "Llama-3.1-70B"),
                    "--gpu-memory", "80GiB")  # fmt: skip
    assert "does not fit: weights 131.48 GiB" in line and " by 61.9" in line


def test_plan_refuses_a_max_model_len_without_room_and_honours_a_shorter_one(capsys):
    qwen = str(PUBLISHED / "Qwen3-32B")
    line = refused(capsys, "plan", "--model", qwen, "--gpu-memory", "80GiB")
    assert "one sequence of max_model_len 40,960 needs 10.00 GiB" in line and "short by" in line
    got = plan_json(capsys, "--model", qwen, "--gpu-memory", "80GiB", "--max-model-len", "8192")
    assert got["max_model_len"] == 8192 and got["max_concurrency_at_max_model_len"] >= 1


@pytest.mark.old_config_keys  # engine.num_slots, the previous release's path, read once
def test_plan_takes_engine_settings_and_sizes(capsys):
    llama = str(PUBLISHED / "Llama-3.1-8B")
    base = plan_json(capsys, "--model", llama, "--gpu-memory", "80GiB")
    lower = plan_json(capsys, "--model", llama, "--gpu-memory", "80GiB",
                      "--set", "engine.gpu_memory_utilization=0.5",
                      "--set", "engine.adapters.num_slots=9")  # fmt: skip
    assert lower["budget_bytes"] == int(0.5 * 80 * GiB) - 512 * 2**20
    assert lower["num_slots"] == 9 and lower["kv_cache_bytes"] < base["kv_cache_bytes"]
    old = plan_json(capsys, "--model", llama, "--gpu-memory", "80GiB",
                    "--set", "engine.gpu_memory_utilization=0.5",
                    "--set", "engine.num_slots=9")  # fmt: skip
    assert old == lower  # the previous release's path, read for one more
    h200 = plan_json(capsys, "--model", llama, "--gpu-memory", "141GB", "--dtype", "float16")
    assert h200["device_bytes"] == 141 * 10**9
    assert "expected engine.KEY=VALUE" in refused(
        capsys, "plan", "--model", llama, "--gpu-memory", "80GiB", "--set", "num_slots=4"
    )
    assert "expected a size such as 80GiB" in refused(
        capsys, "plan", "--model", llama, "--gpu-memory", "lots"
    )
    assert "error: gpu_memory_utilization: Input should be less than or equal to 1" in refused(
        capsys, "plan", "--model", llama, "--gpu-memory", "80GiB",
        "--set", "engine.gpu_memory_utilization=1.5",
    )  # fmt: skip


def test_plan_reports_the_checkpoint_index_total_size(capsys, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(PUBLISHED / "Llama-3.1-8B", model)
    index = {"metadata": {"total_size": 16_060_522_496}, "weight_map": {}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "80GiB")
    assert got["checkpoint_bytes"] == 16_060_522_496
    assert got["weights_bytes_per_gpu"] == 16_060_522_496 + 2 * 2 * 131072 * 128  # + rope


def test_plan_covers_every_family_of_the_repo(capsys):
    for family in FAMILY_CONFIGS:
        got = plan_json(capsys, "--model", str(family_model_dir(family)), "--gpu-memory", "1GiB",
                        "--tp", "2")  # fmt: skip
        assert got["kv_cache_tokens"] >= got["max_model_len"] > 0, family


@pytest.mark.parametrize(
    "name, gpu, tp",
    [("Mistral-7B-v0.3", "80GiB", 1), ("Phi-3-mini-4k-instruct", "80GiB", 1),
     ("Qwen2.5-7B-Instruct", "80GiB", 1), ("gemma-2-27b", "80GiB", 1),
     ("gemma-3-27b-it", "80GiB", 2), ("Mixtral-8x7B-Instruct-v0.1", "141GB", 1),
     ("Qwen3.5-27B", "141GB", 1), ("Qwen3.6-35B-A3B", "80GiB", 2),
     ("gemma-4-31B", "80GiB", 4), ("gemma-4-26B-A4B", "141GB", 1),
     ("gemma-4-E2B", "80GiB", 1), ("gpt-oss-120b", "141GB", 1),
     ("Qwen3.5-397B-A17B", "141GB", 8)],
)  # fmt: skip
def test_plan_of_each_published_flagship_at_its_gpu_count(capsys, name, gpu, tp):
    """Each family's flagship on the fewest H100s or H200s it plans on (docs/models.md's
    table): the command's JSON is the replica's plan."""
    model = PUBLISHED / name
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", gpu, "--tp", str(tp))
    size = 80 * GiB if gpu == "80GiB" else 141 * 10**9
    config = EngineConfig(model=str(model), device="cuda", tp_size=tp)
    expected = plan_memory(load_model_spec(model), config, torch.bfloat16, size).to_json()
    assert {k: got[k] for k in KEYS} == {k: expected[k] for k in KEYS}


@pytest.mark.parametrize(
    "name, gpu, tp, says, settings",
    [("Qwen2.5-7B-Instruct", "80GiB", 8, "num_attention_heads=28 is not a multiple of 8", ()),
     ("Qwen3.5-397B-A17B", "80GiB", 8, "more tensor-parallel ranks split the weights", ()),
     ("Qwen3.5-397B-A17B", "141GB", 8, "lower engine.max_lora_rank or raise tp_size",
      ("--set", "engine.lora_experts=true"))],
)  # fmt: skip
def test_plan_refuses_a_flagship_that_cannot_run_so_in_one_line(
    capsys, name, gpu, tp, says, settings
):
    line = refused(capsys, "plan", "--model", str(PUBLISHED / name), "--gpu-memory", gpu,
                   "--tp", str(tp), *settings)  # fmt: skip
    assert says in line


def test_expert_lora_arenas_are_planned_only_when_asked_for(capsys):
    """Qwen3-30B-A3B on one 80 GiB GPU: a rank row in its 128 experts' arenas on 48
    layers costs 63x one in attention's, so with engine.lora_experts the arenas hold one
    adapter of rank 64 (the least the plan keeps room for); by default, without them,
    many, and the plan says how many for each."""
    model = str(PUBLISHED / "Qwen3-30B-A3B")
    plain = plan_json(capsys, "--model", model, "--gpu-memory", "80GiB")
    experts = plan_json(capsys, "--model", model, "--gpu-memory", "80GiB",
                        "--set", "engine.lora_experts=true")  # fmt: skip
    print(f"max_loras_per_batch: {plain['max_loras_per_batch']} by default, "
          f"{experts['max_loras_per_batch']} with engine.lora_experts")  # fmt: skip
    assert experts["max_loras_per_batch"] == 1
    assert plain["max_loras_per_batch"] >= 16 * experts["max_loras_per_batch"]
    assert plain["adapter_memory_bytes"] < experts["adapter_memory_bytes"]
    assert plain["kv_cache_bytes"] > experts["kv_cache_bytes"]


def quantized_copy(tmp_path, name: str, quant: dict):
    model = tmp_path / name
    shutil.copytree(PUBLISHED / name, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant}))
    return model


def test_plan_counts_block_fp8_weights_packed_and_refuses_a_split_inside_a_block(capsys, tmp_path):
    """Qwen3-32B-FP8 (Qwen's 128x128 blocks): every projection at a byte a weight plus an
    fp32 scale per block, the embedding and head in bf16. 16 ranks would split each
    MLP's 25600 columns at 1600, inside a block: refused naming the layer."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    model = quantized_copy(tmp_path, "Qwen3-32B", fp8)
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "80GiB",
                    "--max-model-len", "8192")  # fmt: skip
    dense = plan_json(capsys, "--model", str(PUBLISHED / "Qwen3-32B"), "--gpu-memory", "80GiB",
                      "--max-model-len", "8192")  # fmt: skip
    h, q, kv, i = 5120, 64 * 128, 8 * 128, 25600
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]  # (out, in)
    packed = sum(n * k + -(-n // 128) * -(-k // 128) * 4 for n, k in shapes)
    saved = 64 * (sum(n * k * 2 for n, k in shapes) - packed)
    assert got["weights_bytes_per_gpu"] == dense["weights_bytes_per_gpu"] - saved
    assert got["kv_cache_bytes"] > dense["kv_cache_bytes"]
    line = refused(capsys, "plan", "--model", str(model), "--gpu-memory", "80GiB", "--tp", "16")
    assert "tp_size=16 cannot split the quantized model: model.layers.0.mlp.gate_proj" in line
    assert "cut its scale blocks of 128" in line


def test_plan_fits_llama_70b_in_w4a16_on_the_gpu_bf16_does_not(capsys, tmp_path):
    w4a16 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                 "group_size": 128}}}, "ignore": ["lm_head"]}  # fmt: skip
    model = quantized_copy(tmp_path, "Llama-3.1-70B", w4a16)
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "80GiB",
                    "--max-model-len", "8192")  # fmt: skip
    assert 36 * GiB < got["weights_bytes_per_gpu"] < 37 * GiB  # 131.48 GiB in bf16


def test_plan_counts_a_block_fp8_qwen3_5_moe_packed(capsys, tmp_path):
    """Qwen3.5-MoE in Qwen's 128x128 FP8 (tiny): the Gated DeltaNet's in_proj_qkv, in_proj_z
    and out_proj, attention, every expert and the shared expert at a byte a weight plus an
    fp32 scale per block, in_proj_b / in_proj_a dense as the config names them; the split
    of in_proj_qkv's 16 q rows on 2 ranks is refused naming it."""
    from tests.quant_checkpoints import quantize_dir

    src = family_model_dir("qwen35moe")
    linear = [f"model.language_model.layers.{i}.linear_attn.in_proj_{m}"
              for i in (0, 2) for m in ("b", "a")]  # fmt: skip
    model = tmp_path / "fp8"
    quantize_dir(src, model, "fp8-block", tuple(linear))
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "1GiB")
    dense = plan_json(capsys, "--model", str(src), "--gpu-memory", "1GiB")
    h, e, i, s = 64, 4, 32, 48
    mixer = [(136, h), (72, h), (h, 72)]  # in_proj_qkv, in_proj_z, out_proj
    attention = [(256, h), (64, h), (64, h), (h, 128)]  # q (with its gate rows), k, v, o
    mlp = e * [(i, h), (i, h), (h, i)] + [(s, h), (s, h), (h, s)]  # experts, shared expert
    shapes = 2 * mixer + 2 * attention + 4 * mlp  # (out, in) of each packed weight
    packed = sum(n * k + -(-n // 128) * -(-k // 128) * 4 for n, k in shapes)
    saved = sum(n * k * 2 for n, k in shapes) - packed  # against bf16
    assert got["weights_bytes_per_gpu"] == dense["weights_bytes_per_gpu"] - saved
    line = refused(capsys, "plan", "--model", str(model), "--gpu-memory", "1GiB", "--tp", "2")
    assert "layers.0.linear_attn.in_proj_qkv (fp8): its output rows 0:16 on rank 0" in line


def test_plan_counts_gemma4_moe_experts_packed_when_the_checkpoint_holds_them_so(capsys, tmp_path):
    """A W4A16 Gemma 4 MoE with its experts un-fused per expert and packed: the plan's
    weights are what the loaded model holds (bf16), read from the checkpoint's tensor
    names; from its config.json alone the experts count dense, said on the weights line
    and in the JSON."""
    from replica.model.decoder import CausalLM
    from tests.engines import held_bytes
    from tests.quant_checkpoints import quantize_gemma4

    model = tmp_path / "w4a16"
    quantize_gemma4(family_model_dir("gemma4moe"), model, "ct-w4a16-g16", ple=False)
    got = plan_json(capsys, "--model", str(model), "--gpu-memory", "1GiB")
    assert got["weights_bytes_per_gpu"] == held_bytes(CausalLM(model, "cpu", torch.bfloat16))
    assert got["weights_note"] is None
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model / "config.json", config_only)
    alone = plan_json(capsys, "--model", str(config_only), "--gpu-memory", "1GiB")
    assert alone["weights_bytes_per_gpu"] > got["weights_bytes_per_gpu"]
    assert "experts counted dense, an upper bound" in alone["weights_note"]
    _, out, _ = run_cli(capsys, "plan", "--model", str(config_only), "--gpu-memory", "1GiB")
    weights = next(line for line in out.splitlines() if line.startswith("weights"))
    assert alone["weights_note"] in weights


def test_an_unserved_quantized_checkpoint_is_refused_on_every_command(
    capsys,
    tmp_path,
    nothing_starts,  # noqa: F811
):
    model = tmp_path / "qwen3-gguf"
    write_gguf_labelled_qwen3(model)
    named = "quantization_config with quant_method='gguf' is not served"
    assert named in refused(capsys, "plan", "--model", str(model), "--gpu-memory", "80GiB")
    assert named in refused(capsys, "generate", "--model", str(model), "--prompt", "hi")
    line = refused(capsys, "up", "--model", str(model))
    assert line.startswith("lorafleet: error: applications[0].args.engine.model:") and named in line


def test_generate_runs_dummy_weights_from_config_and_tokenizer_alone(capsys, tiny, tmp_path):
    model = config_only(tiny.model_dir, tmp_path / "model")
    code, out, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "ab",
                             "--load-format", "dummy", "--max-tokens", "3", "--json")  # fmt: skip
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["output_token_ids"]) == 3
