"""Adapter memory sized from a budget and held at each adapter's own rank: the arithmetic,
the arenas it allocates, the rows adapters hold, and batches running more adapters than
the old fixed count of 7 (and more than max-rank slots would hold), against
transformers + PEFT."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from replica.adapters.memory import (
    CPU_BUDGET_BYTES,
    MAX_DEFAULT_SLOTS,
    size_adapter_slots,
    slot_bytes,
)
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.model.lora_slots import LoRASlotBuffers
from replica.model.spec import load_model_spec
from replica.model.tp_shard import TPShard
from replica.wire import GenerateRequest, SamplingParams
from tests.engines import make_engine
from tests.oracle import hf_greedy, hf_model

CPU = torch.device("cpu")


def buffer_bytes(lora: LoRASlotBuffers) -> int:
    return sum(
        t.numel() * t.element_size()
        for groups in lora.layers
        for buf in groups.values()
        for t in (buf.a, buf.b)
    )


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_bytes_are_what_the_buffers_allocate(demo, tp_size, dtype):
    spec = load_model_spec(demo.model_dir)
    shapes = None if tp_size == 1 else TPShard(spec, 0, tp_size).lora_shapes()
    lora = LoRASlotBuffers(spec, 3, 16, CPU, dtype, shapes)  # 2 adapters of rank 16
    assert buffer_bytes(lora) == lora.nbytes() == 2 * slot_bytes(spec, 16, dtype, tp_size)
    # bytes are per rank row: a rank-16 block is a quarter of a rank-64 one
    row = slot_bytes(spec, 1, dtype, tp_size)
    assert 16 * row == slot_bytes(spec, 16, dtype, tp_size)
    assert 64 * row == slot_bytes(spec, 64, dtype, tp_size)


def test_budget_sets_the_slot_count_and_the_batch_limit(tiny):
    spec = load_model_spec(tiny.model_dir)
    per_slot = slot_bytes(spec, 64, torch.float32)
    base = EngineConfig(model=str(tiny.model_dir), device="cpu")
    sized = size_adapter_slots(
        base.with_adapters(adapter_memory_bytes=5 * per_slot + per_slot // 2),
        spec, torch.float32, CPU_BUDGET_BYTES,
    )  # fmt: skip
    # 5 adapters of max_lora_rank (slot 0, the base, holds no memory)
    assert (sized.adapters.num_slots, sized.adapters.max_loras_per_batch) == (6, 5)
    assert sized.adapters.adapter_memory_bytes is None  # what ranks are built from: a count
    EngineConfig(**sized.model_dump())  # and it validates again (TP workers rebuild it)
    capped = base.model_copy(update={"max_num_seqs": 8}).with_adapters(
        adapter_memory_bytes=40 * per_slot
    )

    def size(cfg: EngineConfig) -> EngineConfig:
        return size_adapter_slots(cfg, spec, torch.float32, CPU_BUDGET_BYTES)

    assert size(capped).adapters.max_loras_per_batch == 8
    chosen = capped.with_adapters(max_loras_per_batch=3)
    assert size(chosen).adapters.max_loras_per_batch == 3
    fixed = base.with_adapters(num_slots=4)
    assert size(fixed).adapters.num_slots == 4
    # the default budget: 1 GiB on CPU, which holds thousands of tiny slots: capped
    default = size(base)
    assert (1 << 30) // per_slot > MAX_DEFAULT_SLOTS == default.adapters.num_slots
    # a set budget is taken as it is, past the default's cap
    many = base.with_adapters(adapter_memory_bytes=(MAX_DEFAULT_SLOTS + 9) * per_slot)
    assert size(many).adapters.num_slots == MAX_DEFAULT_SLOTS + 10


def test_num_parameters_counts_the_checkpoint(tiny):
    import math

    from safetensors import safe_open

    spec = load_model_spec(tiny.model_dir)
    total = 0
    for path in tiny.model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "bias" not in k)
    assert spec.num_parameters() == total


def test_a_budget_below_one_adapter_of_max_rank_is_a_config_error_at_start(tiny):
    spec = load_model_spec(tiny.model_dir)
    per_slot = slot_bytes(spec, 64, torch.float32)
    cfg = EngineConfig(
        model=str(tiny.model_dir), device="cpu", adapters={"adapter_memory_bytes": per_slot - 1}
    )
    with pytest.raises(ValueError, match="less than one adapter of max_lora_rank 64.*Raise"):
        LLMEngine(cfg)
    # a smaller max rank makes the same budget enough: 3 adapters of rank 16
    eng = LLMEngine(cfg.model_copy(update={"max_lora_rank": 16}))
    assert eng.residency()["num_slots"] == 4
    assert eng.residency()["adapter_rows"] == 48 * 4  # in each of the 4 groups' arenas
    with pytest.raises(ValidationError, match="not both"):
        EngineConfig(model="m", adapters={"num_slots": 4, "adapter_memory_bytes": 1 << 20})


def test_more_adapters_than_the_old_seven_run_in_one_batch_like_peft(tiny):
    """Ten adapter names (the four tiny adapters of ranks 8-64, registered under several
    names) in one batch of an engine sized for 12 slots: every request runs in the same
    steps and decodes what transformers + PEFT decode with its adapter."""
    spec = load_model_spec(tiny.model_dir)
    budget = 11 * slot_bytes(spec, 64, torch.float32)
    cfg = EngineConfig(
        model=str(tiny.model_dir),
        device="cpu",
        kv_cache_bytes=16 << 20,
        adapters={
            "adapter_memory_bytes": budget,
            "adapter_loading": "sync",
            "max_loads_in_flight": 10,
        },
    )
    eng = LLMEngine(cfg)
    assert (eng.config.adapters.num_slots, eng.config.adapters.max_loras_per_batch) == (12, 11)
    dirs = list(tiny.adapters.values())
    one_batch_equals_peft(eng, tiny, {f"copy{i}": dirs[i % len(dirs)] for i in range(10)})


def one_batch_equals_peft(eng: LLMEngine, tiny, names: dict, first_step=None) -> None:
    """Register `names` (name -> PEFT directory), send one greedy request per name: all
    run in the first batch (`first_step(eng)` checks more there) and each decodes what
    transformers + PEFT decode with its adapter."""
    for name, path in names.items():
        eng.load_adapter(name, path)
    g = torch.Generator().manual_seed(3)
    vocab = eng.spec.vocab_size
    prompts = [torch.randint(3, vocab, (4 + i,), generator=g).tolist() for i in range(len(names))]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    seqs = [eng.add_request(GenerateRequest(p, greedy, n)) for p, n in zip(prompts, names)]
    eng.step()
    running = {s.lora_key for s in eng.scheduler.running}
    assert running == set(names), "every adapter should be admitted into the first batch"
    if first_step is not None:
        first_step(eng)
    for _ in range(50):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work()
    oracles = {path: hf_model(tiny.model_dir, path) for path in set(names.values())}
    for seq, prompt, name in zip(seqs, prompts, names):
        assert seq.output_ids == hf_greedy(oracles[names[name]], prompt, 5), name


def test_adapters_hold_their_own_rank_and_five_share_two_max_rank_blocks_like_peft(tiny):
    """Arenas sized for 2 adapters of rank 64 (128 rank rows a group) hold the tiny
    adapters of ranks 64, 32, 16 and 8 plus a second rank-8 one at once (64+32+16+8+8
    rows of qkv_proj, which all target): all five run in one batch, decode what
    transformers + PEFT decode, and each group's rows held are exactly the ranks of the
    adapters targeting it (rank 64 and 8 target every group, 16 attention, 32 q/v)."""
    spec = load_model_spec(tiny.model_dir)
    eng = make_engine(tiny, {}, num_slots=3, max_loras_per_batch=5,
                      adapter_loading="sync", max_loads_in_flight=5)  # fmt: skip
    row = slot_bytes(spec, 1, torch.float32)
    assert eng.executor.lora.nbytes() == 128 * row  # no slot padded to max_lora_rank
    by_rank = {peft_rank(path): path for path in tiny.adapters.values()}
    assert sorted(by_rank) == [8, 16, 32, 64]

    def holds_their_ranks(eng: LLMEngine) -> None:
        used = {g: arena.rows_used for g, arena in eng.adapters.pool.arenas.items()}
        mlp = 64 + 8 + 8
        assert used == {"qkv_proj": 128, "o_proj": mlp + 16, "gate_up_proj": mlp, "down_proj": mlp}
        assert eng.residency()["adapter_rows_used"] == sum(used.values())

    names = {f"r{r}": p for r, p in by_rank.items()} | {"r8-again": by_rank[8]}
    one_batch_equals_peft(eng, tiny, names, holds_their_ranks)
    assert eng.adapters.pool.num_evictions == 0


def peft_rank(path) -> int:
    import json

    return json.loads((path / "adapter_config.json").read_text())["r"]


def test_a_load_reserves_exactly_its_ranks_before_the_weights_are_in_host_memory(tiny):
    """With nothing staged in host memory the ranks per group come from the source's
    record, made once at registration (the AdapterStore's conversion in a cluster): a
    rank-16 adapter of the attention modules reserves 16 rows of qkv_proj and o_proj and
    none of the MLP's, from its first load on, and holds just those."""
    cfg = EngineConfig(
        model=str(tiny.model_dir), device="cpu", kv_cache_bytes=16 << 20, adapters={"num_slots": 3}
    )
    eng = LLMEngine(cfg)
    pool = eng.adapters.pool
    path = next(p for p in tiny.adapters.values() if peft_rank(p) == 16)
    eng.load_adapter("r16", path)
    eng.adapters.host_cache.drop("r16")  # as a host cache under pressure would
    attention = {"qkv_proj": 16, "o_proj": 16}
    assert eng.adapters.host_cache.peek("r16") is None
    assert eng.adapters.ranks_of("r16") == attention
    reserved = []
    real_write = eng.executor.lora.write

    def write(rows, weights, progress=None):
        slot = pool.slots[pool._by_name["r16"]]
        reserved.append({g: rows for g, (_, rows) in slot.blocks.items()})
        real_write(rows, weights, progress)

    eng.adapters.prefetcher.buffers.write = write
    eng.generate([([5, 6, 7], SamplingParams(temperature=0, max_tokens=2), "r16")])
    assert pool.rows_used == 32
    assert pool.evict("r16") and pool.rows_used == 0
    eng.adapters.host_cache.drop("r16")
    eng.generate([([5, 6, 7], SamplingParams(temperature=0, max_tokens=2), "r16")])
    assert reserved == [attention, attention]  # before each copy: exactly its rows
    assert pool.rows_used == 32 and pool.num_evictions == 0


def test_adapters_of_different_groups_share_memory_at_their_own_offsets_like_peft(tiny, tmp_path):
    """Arenas sized for one rank-64 adapter (64 rows a group): a rank-32 q/v adapter, a
    rank-32 MLP adapter and a rank-8 adapter of every module hold 40 rows of qkv_proj,
    8 of o_proj and 40 of each MLP group, so all three run in one batch without an
    eviction (a block of its largest rank in every group each, 72 rows, could not), the
    rank-8 one at row 0 of o_proj and row 32 of the others; each decodes what
    transformers + PEFT decode."""
    from tests.oracle import build_peft_adapter

    attn = build_peft_adapter(tiny.model_dir, tmp_path / "attn", 0, r=32, lora_alpha=32,
                              target_modules=["q_proj", "v_proj"])  # fmt: skip
    mlp = build_peft_adapter(tiny.model_dir, tmp_path / "mlp", 1, r=32, lora_alpha=16,
                             target_modules=["gate_proj", "up_proj", "down_proj"])  # fmt: skip
    every = next(p for p in tiny.adapters.values() if peft_rank(p) == 8)
    eng = make_engine(tiny, {}, num_slots=2, max_loras_per_batch=3,
                      adapter_loading="sync", max_loads_in_flight=3)  # fmt: skip
    assert eng.adapters.pool.num_rows == 64

    def own_groups_and_offsets(eng: LLMEngine) -> None:
        held = {s.adapter: s.offsets for s in eng.adapters.pool.slots if s.adapter}
        assert held == {
            "attn": {"qkv_proj": 0},
            "mlp": {"gate_up_proj": 0, "down_proj": 0},
            "every": {"qkv_proj": 32, "o_proj": 0, "gate_up_proj": 32, "down_proj": 32},
        }

    names = {"attn": attn, "mlp": mlp, "every": every}
    one_batch_equals_peft(eng, tiny, names, own_groups_and_offsets)
    assert eng.adapters.pool.num_evictions == 0
