"""The memory plan: its terms against what the model allocates (meta device) and against
hand calculations from the published config.json values of Llama-3.1-8B/70B, Qwen3-32B
and Qwen3-30B-A3B; its refusals; and how a CUDA replica measures and uses it (torch.cuda's
memory functions monkeypatched on this CPU machine)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cluster.demo.assets import ARCHS
from cluster.demo.families import FAMILY_CONFIGS, family_model_dir
from replica.adapters.memory import slot_bytes
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.executor import memory_plan as mp
from replica.executor import memory_profile
from replica.executor.memory_plan import MemoryPlanError, plan_memory, step_bytes
from replica.executor.static_decode import DecodeInputs
from replica.model.decoder import CausalLM
from replica.model.kv_cache import KVCache
from replica.model.lora import workspace_columns
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import load_model_spec
from replica.model.tp_layers import TPRank
from replica.model.tp_shard import TPShard
from tests.conftest import tiny_assets
from tests.engines import held_bytes
from tests.model_dirs import PUBLISHED

GiB = 2**30
BF16 = torch.bfloat16
META = torch.device("meta")


def published(name: str, **engine) -> tuple:
    model = PUBLISHED / name
    return load_model_spec(model), EngineConfig(model=str(model), device="cuda", **engine)


def family_dirs() -> list[Path]:
    dirs = [family_model_dir(f) for f in FAMILY_CONFIGS]
    return dirs + [tiny_assets(arch).model_dir for arch in ARCHS]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weight_bytes_are_what_every_family_holds(tp_size):
    """Every family of the repo built on the meta device (weights from config.json alone,
    no memory): the plan's weights are the bytes of the tensors the model holds, to the
    byte, whole and as tensor-parallel rank 0's shard."""
    for model_dir in family_dirs():
        spec = load_model_spec(model_dir)
        rank = None if tp_size == 1 else TPRank(TPShard(spec, 0, tp_size), None)
        model = CausalLM(model_dir, META, BF16, None, spec, rank, "dummy")
        assert mp.weight_bytes(spec, tp_size, BF16) == held_bytes(model), model_dir.name


@pytest.mark.parametrize("tp_size", [1, 2])
def test_kv_and_adapter_bytes_are_what_is_allocated(tp_size):
    for model_dir in family_dirs():
        spec = load_model_spec(model_dir)
        local = mp.local_spec(spec, tp_size)
        kv = KVCache(local, 7, 16, META, BF16)
        allocated = sum(t.numel() * t.element_size() for t in kv.pools)
        assert allocated == 7 * mp.kv_block_bytes(spec, tp_size, 16, BF16), model_dir.name
        shapes = None if tp_size == 1 else TPShard(spec, 0, tp_size).lora_shapes
        lora = LoRASlotBuffers(spec, 5, 16, META, BF16, shapes)
        config = EngineConfig(
            model=str(model_dir),
            max_lora_rank=16,
            tp_size=tp_size,
            kv_cache_bytes=1 << 20,
            adapters={"num_slots": 5},
        )
        plan = plan_memory(spec, config, BF16, 80 * GiB)
        assert plan.adapter_memory_bytes == lora.nbytes(), model_dir.name


def test_llama_3_1_8b_on_one_80gib_gpu_by_hand():
    """Every term from the published shapes (hidden 4096, MLP 14336, 32 layers, 32 heads,
    8 KV heads of 128, vocab 128256, context 131072), bf16, engine defaults."""
    spec, config = published("Llama-3.1-8B")
    plan = plan_memory(spec, config, BF16, 80 * GiB)
    h, i, layers, kv, vocab, ctx = 4096, 14336, 32, 8 * 128, 128256, 131072
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h  # q, k, v, o, MLP, 2 norms
    params = layers * per_layer + 2 * vocab * h + h  # untied head, final norm
    assert params == 8_030_261_248  # "8B"
    rope = 2 * ctx * 128  # one cos and one sin table
    assert plan.weights_bytes_per_gpu == 2 * (params + rope) == 16_127_631_360
    assert plan.kv_block_bytes == 16 * layers * 2 * kv * 2  # 128 KiB a token
    # the largest step: 2048 tokens of a chunk ending at 131072, a logit row each
    t, cols = 2048, layers * 7 * 64  # LoRA workspace: 7 slices of rank 64 per layer
    persistent = t * h * 2 + t * cols * 4
    # q/k/v and the rotated q and k; the output, SDPA flash's own output and log-sum-exp
    # and the K/V it gathers for the context
    attention = t * (h + 2 * kv) * 2 + t * (h + kv) * 2 + 2 * t * h * 2 + t * 32 * 4
    attention += 2 * 8 * ctx * 128 * 2
    head = t * h * 2 + t * vocab * 2 + t * vocab * 4
    assert head > attention  # the logits of 2048 rows are the peak
    sampler = 64 * vocab * 16
    assert plan.activation_bytes == persistent + head + sampler == 1_858_338_816
    # graphs: the shared fp32 logits buffer of 64 rows and a 64-token decode step's pool
    pool = 64 * h * 2 + 64 * cols * 4 + 64 * h * 2 + 64 * vocab * 2
    inputs = DecodeInputs.device_bytes(64, ctx // 16)  # block tables wide as 128k tokens
    assert plan.graph_bytes == 64 * vocab * 4 + inputs + pool
    budget = int(0.9 * 80 * GiB) - 512 * 2**20  # less the CUDA context
    assert plan.budget_bytes == budget
    left = budget - plan.weights_bytes_per_gpu - plan.activation_bytes - plan.graph_bytes
    left -= plan.kv_block_bytes  # the static decode path's scratch block
    adapter = layers * 64 * 2 * (3 * h + (h + 2 * kv) + 2 * h + 2 * h + 2 * i + i + h)
    assert adapter == 320 * 2**20  # one adapter of rank 64 on every module
    assert plan.num_slots - 1 == int(left * 0.25) // adapter == 43
    assert plan.adapter_memory_bytes == 43 * adapter
    assert plan.kv_cache_bytes == left - 43 * adapter
    assert plan.num_blocks == 21_122 and plan.kv_cache_tokens == 337_952
    assert plan.max_model_len == ctx
    assert plan.max_concurrency_at_max_model_len == round(21_122 / (ctx // 16), 2) == 2.58
    assert 0 <= plan.free_bytes < plan.kv_block_bytes


def test_llama_3_1_70b_and_qwen3_32b_at_tp_4_by_hand():
    spec, config = published("Llama-3.1-70B", tp_size=4)
    plan = plan_memory(spec, config, BF16, 80 * GiB)
    h, i, kv, q = 8192, 28672 // 4, 2 * 128, 16 * 128  # a rank's 16 heads and 2 KV heads
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    params = 80 * per_layer + 2 * (128256 // 4) * h + h
    assert plan.weights_bytes_per_gpu == 2 * (params + 2 * 131072 * 128)
    assert plan.kv_block_bytes == 16 * 80 * 2 * kv * 2
    # every rank captures decode graphs: the full-vocab logits buffer and inputs each
    assert plan.graph_bytes > 64 * 128256 * 4 + DecodeInputs.device_bytes(64, 131072 // 16)
    assert plan.max_model_len == 131072 and plan.num_blocks > 3 * 131072 // 16 * 0.9
    assert 0 <= plan.free_bytes < plan.kv_block_bytes

    spec, config = published("Qwen3-32B", tp_size=4)
    plan = plan_memory(spec, config, BF16, 80 * GiB)
    h, i, kv, q = 5120, 25600 // 4, 2 * 128, 16 * 128
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * 128  # q/k norms
    params = 64 * per_layer + 2 * (151936 // 4) * h + h
    assert plan.weights_bytes_per_gpu == 2 * (params + 2 * 40960 * 128)
    assert plan.kv_block_bytes == 16 * 64 * 2 * kv * 2
    assert plan.max_model_len == 40960
    assert 0 <= plan.free_bytes < plan.kv_block_bytes


def test_qwen3_30b_a3b_on_one_80gib_gpu_by_hand():
    """128 experts of 768 columns, top-8, on all 48 layers: the experts dominate the
    weights, and with engine.lora_experts one expert adapter of rank 64 holds rows for
    every expert; by default its arenas have attention's groups alone."""
    spec, config = published("Qwen3-30B-A3B", lora_experts=True)
    plan = plan_memory(spec, config, BF16, 80 * GiB)
    h, e, moe, kv, q = 2048, 128, 768, 4 * 128, 32 * 128
    per_layer = h * (q + 2 * kv) + q * h + e * (3 * h * moe + h) + 2 * h + 2 * 128
    params = 48 * per_layer + 2 * 151936 * h + h
    assert params == 30_532_122_624  # "30B"
    assert plan.weights_bytes_per_gpu == 2 * (params + 2 * 40960 * 128)
    assert plan.kv_block_bytes == 16 * 48 * 2 * kv * 2
    attention_rows = 3 * h + (q + 2 * kv) + q + h
    expert_rows = e * (2 * h + 2 * moe + moe + h)
    adapter = 48 * 64 * 2 * (attention_rows + expert_rows)
    assert adapter == slot_bytes(spec, 64, BF16, experts=True) == 6_750_732_288
    # a quarter of what is left would hold none: the default makes room for one
    assert plan.num_slots == 2 and plan.adapter_memory_bytes == adapter
    assert plan.max_model_len == 40960 and plan.max_concurrency_at_max_model_len >= 1
    plain = plan_memory(spec, config.model_copy(update={"lora_experts": False}), BF16, 80 * GiB)
    attention = 48 * 64 * 2 * attention_rows
    assert attention == slot_bytes(spec, 64, BF16) == 106_954_752
    assert plain.adapter_memory_bytes == (plain.num_slots - 1) * attention
    assert plain.num_slots - 1 > 16 * (plan.num_slots - 1)


def test_llama_70b_on_one_80gib_gpu_is_refused_by_how_much():
    spec, config = published("Llama-3.1-70B")
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(spec, config, BF16, 80 * GiB)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("llama at tp_size=1 does not fit: weights 131.48 GiB")
    assert "a budget of 71.50 GiB per GPU by 61.9" in message and "tensor-parallel" in message


def test_no_room_for_one_sequence_of_max_model_len_is_refused_with_the_numbers():
    """Qwen3-32B on one GPU: the weights fit, one sequence of its 40960 tokens does not;
    a shorter max_model_len from the config is honoured."""
    spec, config = published("Qwen3-32B")
    with pytest.raises(MemoryPlanError, match=r"one sequence of max_model_len 40,960 needs "
                                              r"10.00 GiB of KV cache.*short by"):  # fmt: skip
        plan_memory(spec, config, BF16, 80 * GiB)
    shorter = config.model_copy(update={"max_model_len": 8192})
    plan = plan_memory(spec, shorter, BF16, 80 * GiB)
    assert plan.max_model_len == 8192 and plan.max_concurrency_at_max_model_len >= 1


def test_an_explicit_kv_cache_wins_within_the_budget():
    spec, config = published("Llama-3.1-8B")
    planned = plan_memory(spec, config, BF16, 80 * GiB)
    set_kv = config.model_copy(update={"kv_cache_bytes": 8 * GiB})
    plan = plan_memory(spec, set_kv, BF16, 80 * GiB)
    assert plan.kv_cache_bytes == 8 * GiB and plan.max_model_len == 8 * GiB // (128 * 2**10)
    # the adapters' default: a share of what the set KV cache leaves
    left = planned.adapter_memory_bytes + planned.kv_cache_bytes
    assert plan.num_slots - 1 == int((left - 8 * GiB) * 0.25) // (320 * 2**20)
    with pytest.raises(MemoryPlanError, match="engine.kv_cache_bytes is 8.00 GiB: short by 8.00"):
        plan_memory(spec, set_kv.model_copy(update={"max_model_len": 131072}), BF16, 80 * GiB)
    with pytest.raises(MemoryPlanError, match="kv_cache_bytes 70.00 GiB exceeds .* by"):
        plan_memory(spec, config.model_copy(update={"kv_cache_bytes": 70 * GiB}), BF16, 80 * GiB)
    # memory already in use on the device comes out of the budget
    busy = plan_memory(spec, config, BF16, 80 * GiB, in_use_bytes=10 * GiB)
    assert busy.budget_bytes == planned.budget_bytes - 10 * GiB + 512 * 2**20


def test_step_bytes_budget_what_the_fused_prefill_paths_allocate():
    """A chunk over a long context: in bf16 SDPA's flash kernel runs it, gathering its K
    and V out of the cache (and returning its own output and log-sum-exp); the Triton
    kernel (fp32, soft caps) reads the cache in place, so there the context adds nothing.
    No [T, C] mask or score tensor on any path."""
    spec, config = published("Llama-3.1-8B")
    short = step_bytes(spec, config, BF16, 2048, 2048, 1, fp32_logits=False)
    long = step_bytes(spec, config, BF16, 2048, 131072, 1, fp32_logits=False)
    persistent = 2048 * 4096 * 2 + 2048 * 32 * 7 * 64 * 4
    assert short == persistent + 2048 * (4096 + 4 * 14336) * 2  # the MLP's phase
    qkv_rotated = 2048 * (4096 + 2 * 1024) * 2 + 2048 * (4096 + 1024) * 2
    output, flash = 2048 * 4096 * 2, 2048 * 4096 * 2 + 2048 * 32 * 4
    gather = 2 * 8 * 131072 * 128 * 2
    assert long == persistent + qkv_rotated + output + flash + gather
    fp32 = [step_bytes(spec, config, torch.float32, 2048, c, 1) for c in (2048, 131072)]
    assert fp32[0] == fp32[1]
    gemma2 = load_model_spec(family_model_dir("gemma2"))  # soft caps: the Triton kernel
    uncapped = gemma2.__class__(**{**gemma2.__dict__, "attn_soft_cap": None})
    capped = [step_bytes(gemma2, config, BF16, 2048, c, 1) for c in (2048, 131072)]
    assert capped[0] == capped[1]
    assert step_bytes(uncapped, config, BF16, 2048, 131072, 1) > capped[1]


# -- at start on CUDA: torch.cuda's memory functions, monkeypatched ----------------------


class FakeCuda:
    """torch.cuda's memory accounting for a replica on this CPU: a device of `total`
    bytes with `others` in use by other processes; our allocations as set by the test."""

    def __init__(self, monkeypatch, total: int, others: int = 0) -> None:
        self.total, self.others, self.allocated, self.peak_extra = total, others, 0, 0
        self.resets = 0
        for name in ("synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(
            torch.cuda, "max_memory_allocated", lambda device=None: self.allocated + self.peak_extra
        )
        monkeypatch.setattr(torch.cuda, "mem_get_info", self._info)

    def _reset(self, device=None) -> None:
        self.resets += 1

    def _info(self, device=None) -> tuple[int, int]:
        return self.total - self.others - self.allocated, self.total


def test_a_single_rank_profiles_the_largest_step_and_plans_from_it(tiny, monkeypatch):
    """The profile runs one forward: max_num_batched_tokens tokens of a chunk ending at
    max_model_len (KV for the whole sequence), LoRA on in every group at max_lora_rank, a
    logit row per token; its peak and the device's numbers make the plan."""
    cuda = FakeCuda(monkeypatch, total=8 * GiB, others=GiB)
    cfg = EngineConfig(
        model=str(tiny.model_dir),
        max_lora_rank=16,
        max_num_batched_tokens=48,
        max_model_len=200,
        adapters={"num_slots": 3},
    )
    spec = load_model_spec(tiny.model_dir)
    lora = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    model = CausalLM(tiny.model_dir, "cpu", torch.float32, lora, spec)
    seen = {}
    forward = model.forward

    def measured_forward(batch, kv, rows):
        seen.update(tokens=batch.input_ids.numel(), positions=batch.positions.tolist(),
                    context=batch.attn.prefill_context_lens, kv_tokens=kv.k[0].shape[1],
                    rows=rows.numel(), lora={g: s.has_lora for g, s in batch.lora.items()},
                    ranks={g: int(s.slot_ranks[1]) for g, s in batch.lora.items()})  # fmt: skip
        cuda.peak_extra = step_peak  # what the forward allocates beyond what was held
        return forward(batch, kv, rows)

    step_peak = 3 * 2**20
    model.forward = measured_forward
    cuda.allocated = 700 * 2**20  # weights, arenas and the rest this process holds
    plan = memory_profile.measured_plan(cfg, spec, model, lora, torch.device("cpu"), torch.float32)
    assert seen["tokens"] == 48 and seen["positions"] == list(range(152, 200))
    assert seen["context"] == [200] and seen["kv_tokens"] == 208 and seen["rows"] == 48
    assert all(seen["lora"].values()) and set(seen["ranks"].values()) == {16}
    assert cuda.resets == 1
    assert plan.activation_source == "profiled"
    assert plan.activation_bytes == 3 * 2**20 + 48 * spec.vocab_size * 16  # + the sampler
    assert plan.weights_bytes_per_gpu == 700 * 2**20 - lora.nbytes()
    assert plan.in_use_bytes == GiB
    assert plan.budget_bytes == int(0.9 * 8 * GiB) - GiB
    assert plan.adapter_memory_bytes == lora.nbytes() and plan.num_slots == 3
    assert 0 <= plan.free_bytes < plan.kv_block_bytes
    # held so that the KV cache gets 5 blocks: 200 tokens need 13
    step_peak = 0
    tight = cfg.model_copy(update={"gpu_memory_utilization": 0.2})
    budget = int(0.2 * 8 * GiB) - GiB
    sampler = 48 * spec.vocab_size * 16
    cuda.allocated = budget - sampler - plan.graph_bytes - 6 * plan.kv_block_bytes
    with pytest.raises(MemoryPlanError, match="one sequence of max_model_len 200 needs"):
        memory_profile.measured_plan(tight, spec, model, lora, torch.device("cpu"),
                                     torch.float32)  # fmt: skip
    cuda.allocated -= 8 * plan.kv_block_bytes
    fits = memory_profile.measured_plan(tight, spec, model, lora, torch.device("cpu"),
                                        torch.float32)  # fmt: skip
    assert fits.num_blocks == 13 and fits.max_model_len == 200


def engine_on_fake_cuda(config: EngineConfig) -> LLMEngine:
    """An LLMEngine as far as its memory sizing, with device cuda (nothing allocated)."""
    engine = object.__new__(LLMEngine)
    engine.device, engine.dtype = torch.device("cuda"), BF16
    engine.spec = load_model_spec(config.model)
    return engine


def test_a_cuda_engine_sizes_from_the_device_before_loading_weights(monkeypatch):
    """Adapters from the plan; a tensor-parallel replica's ranks all get rank 0's KV cache
    and max_model_len (they cannot profile before they are connected); a model that
    cannot fit is refused before any weight is read."""
    FakeCuda(monkeypatch, total=80 * GiB, others=GiB)
    spec, config = published("Llama-3.1-70B", tp_size=4)
    engine = engine_on_fake_cuda(config)
    sized = engine._size_memory(config)
    plan = plan_memory(spec, config, BF16, 80 * GiB, in_use_bytes=GiB)
    assert (sized.adapters.num_slots, sized.adapters.max_loras_per_batch) == (plan.num_slots, 13)
    assert (sized.kv_cache_bytes, sized.max_model_len) == (plan.kv_cache_bytes, 131072)
    single = config.model_copy(update={"tp_size": 1})
    with pytest.raises(MemoryPlanError, match="does not fit"):
        engine._size_memory(single)
    _, eight = published("Llama-3.1-8B")
    one_rank = engine_on_fake_cuda(eight)._size_memory(eight)
    assert one_rank.kv_cache_bytes is None  # the runner sizes it after profiling


def test_cpu_keeps_its_byte_budgets_and_caps_only_a_default_max_model_len(tiny, caplog):
    """Off CUDA the KV cache is 256 MiB unless set. A max_model_len from the config that
    does not fit is refused; the model's own context is capped, with a warning."""
    eng = LLMEngine(
        EngineConfig(model=str(tiny.model_dir), device="cpu", adapters={"num_slots": 2})
    )
    per_block = KVCache.bytes_per_block(eng.spec, 16, torch.float32)
    assert eng.executor.num_blocks == 256 * 2**20 // per_block
    assert eng.executor.memory_plan is None
    small = dict(
        model=str(tiny.model_dir),
        device="cpu",
        kv_cache_bytes=4 * per_block,
        adapters={"num_slots": 2},
    )
    with caplog.at_level(logging.WARNING, logger=memory_profile.__name__):
        eng = LLMEngine(EngineConfig(**small))
    assert eng.max_model_len == 64 and "max_model_len is 64 tokens" in caplog.text
    with pytest.raises(MemoryPlanError, match="max_model_len 100 does not fit .* short by 36"):
        LLMEngine(EngineConfig(**small, max_model_len=100))


def test_the_start_line_says_kv_tokens_blocks_concurrency_and_adapter_rows(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="replica.engine.engine"):
        LLMEngine(
            EngineConfig(
                model=str(tiny.model_dir), device="cpu", max_lora_rank=16, adapters={"num_slots": 3}
            )
        )
    [line] = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert "tokens in" in line and "blocks of 16" in line and "sequences of max_model_len" in line
    assert "32 rank rows per projection group" in line and "2 adapters at rank 16" in line
    spec, config = published("Llama-3.1-8B")
    summary = plan_memory(spec, config, BF16, 80 * GiB).summary()
    for words in ("337,952 tokens in 21,122 blocks of 16", "2.58 sequences of max_model_len",
                  "2752 rank rows per projection group", "CUDA graphs 0.05 GiB"):  # fmt: skip
        assert words in summary


def test_the_state_pool_of_a_hybrid_model_is_planned():
    """Qwen3.5: KV only for the attention layers, and the linear-attention state of
    max_num_seqs sequences and the scratch row, as the pool allocates it, in the plan
    before the adapters and the KV cache."""
    from replica.model.gated_deltanet import StatePool

    model_dir = family_model_dir("qwen35")
    spec = load_model_spec(model_dir)
    config = EngineConfig(model=str(model_dir), max_num_seqs=6, adapters={"num_slots": 3})
    plan = plan_memory(spec, config, BF16, 1 * GiB)
    pool = StatePool(spec.linear_attention, spec.num_layers, 7, META, BF16)
    held = sum(t.numel() * t.element_size() for t in pool.conv + pool.recurrent if t is not None)
    assert plan.state_pool_bytes == held > 0
    assert "state pool" in plan.summary()
    kv = KVCache(spec, 7, 16, META, BF16)
    assert len(kv.pools) == 2 * len(spec.kv_layers) == 4
    assert plan.kv_block_bytes == sum(t.numel() * t.element_size() for t in kv.pools) // 7
    assert plan.planned_bytes == plan.budget_bytes - plan.free_bytes


def test_a_hybrid_model_profiles_its_largest_step_over_a_state_row(monkeypatch):
    """Qwen3.5's profiled step is a later chunk of the longest sequence: its Gated
    DeltaNet layers read and write a state row (one, beside the KV for that sequence)."""
    FakeCuda(monkeypatch, total=8 * GiB, others=GiB)
    model_dir = family_model_dir("qwen35")
    cfg = EngineConfig(model=str(model_dir), adapters={"num_slots": 3}, max_lora_rank=16,
                       max_num_batched_tokens=48, max_model_len=200)  # fmt: skip
    spec = load_model_spec(model_dir)
    lora = LoRASlotBuffers(spec, 3, 16, torch.device("cpu"), torch.float32)
    model = CausalLM(model_dir, "cpu", torch.float32, lora, spec)
    seen = {}
    forward = model.forward

    def measured_forward(batch, kv, rows):
        seen.update(rows=kv.states.num_slots, initial=batch.linear.has_initial_state.tolist())
        return forward(batch, kv, rows)

    model.forward = measured_forward
    plan = memory_profile.measured_plan(cfg, spec, model, lora, torch.device("cpu"), torch.float32)
    assert seen == {"rows": 1, "initial": [True]}
    per_seq = spec.linear_attention.state_bytes_per_seq(torch.float32)
    assert plan.state_pool_bytes == (cfg.max_num_seqs + 1) * per_seq


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_the_plan_counts_the_lora_workspace_columns_the_buffers_assign(family):
    """Layers' groups differ (a hybrid model's linear-attention layers, Gemma 4's
    KV-sharing layers with q alone): the step's LoRA workspace is counted per layer, as
    LoRASlotBuffers lays it out, not as layer 0's times the layers."""
    spec = load_model_spec(family_model_dir(family))
    buffers = LoRASlotBuffers(spec, 2, 8, torch.device("cpu"), torch.float32)
    assert workspace_columns(spec, 8) == buffers.workspace_cols
