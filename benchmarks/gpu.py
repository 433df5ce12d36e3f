"""`python -m benchmarks gpu`: the engine on one GPU at Llama-3.1-8B's shape.

Nothing is downloaded: the bench writes a config.json of Llama-3.1-8B's shape (vocabulary
128,256, 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14,336, llama3 rope) and a
byte-level tokenizer into a temporary directory, and the engine makes random bf16
weights on the device (engine.load_format "dummy"). 16 random rank-16 adapters on all
seven projections are written beside it as PEFT directories. One engine (prefix cache
off, CUDA graphs on) measures:

  decode     ms per decode-only step at batch 1, 8, 32 and 64 over 512-token prompts,
             base and with LoRA (batch b over min(b, 16) adapters, round-robin); the two
             arms alternate, medians
  HBM limit  per step, the bytes it must read (the base weights, every sequence's KV, the
             batch's adapters) over the bandwidth of a device copy measured in this run;
             each step over its limit
  TTFT       one request alone on the engine, 2k, 8k and 32k prompt tokens, without and
             on an adapter
  graphs     LLMEngine.graph_stats() around the decode measurements: graphs captured,
             replays and eager decode steps, counted (never assumed)
  --quant    the base held packed in each format named (fp8: Qwen's 128x128 blocks with
             dynamic activations, so W8A8 on sm89+; w4a16: compressed-tensors groups of
             128), one engine each: its decode steps at batch 1 and 32, base and LoRA, the
             batch-1 step's speedup over bf16 and LoRA's overhead on the packed base

It prints a table, writes every figure with --json, and its last line is one JSON summary
(the headline figures, the graphs, the targets of benchmarks/targets.toml [gpu], each met,
NOT met or unknown; none is asserted). `--dry-run` plans it all on any machine (shapes,
bytes, the engine config, validated) and allocates nothing.

    python -m benchmarks gpu --json gpu.json            # a few minutes on one H100
    python -m benchmarks gpu --quant fp8,w4a16 --json gpu.json  # and two packed bases
    python -m benchmarks gpu --dry-run                  # the plan, no GPU needed
    python -m benchmarks gpu --shape tiny --device cpu  # the same code on a tiny model

Imports only what a bare GPU machine has (torch, transformers, safetensors, numpy) and
pydantic, which `make gpu-kit` stages (replica/config.py); never Ray, httpx or matplotlib.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.adapters import AdapterPlan, write_adapters
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.executor.memory_plan import MemoryPlanError, gib, plan_memory
from replica.model.spec import load_model_spec
from replica.wire import GenerateRequest, SamplingParams

GRAPH_KEYS = ("graphs_captured", "graph_replays", "eager_decode_steps")
DECODE_SLACK = 32  # tokens a decoding sequence may make beyond its timed steps
SMALLEST_GPU_BYTES = 80 * 10**9  # an H100 80GB (an H200 has more): what a plan must fit
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the packed bases --quant measures: the quantization_config the Hub and llm-compressor
# write (benchmarks/quant_engine.py's, here again: this module imports no demo code)
QUANT_FORMATS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]},
    "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                  "group_size": 128}}}, "ignore": ["lm_head"]},
}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's shape: what config.json says and what a step reads."""

    name: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 131072

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def config(self, bos: int, eos: int) -> dict:
        """config.json of a Llama-3.1 model of this shape (llama3 rope, untied head)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },  # fmt: skip
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": bos,
            "eos_token_id": eos,
        }

    def weight_bytes(self, element_size: int) -> int:
        """Bytes of base weights one decode step reads: every layer's projections and
        norms, the final norm and the LM head (the embedding only by row: not counted)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        layer = h * (2 * h + 2 * kv) + 3 * h * self.intermediate_size + 2 * h
        return (self.num_layers * layer + h + self.vocab_size * h) * element_size

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


LLAMA_3_1_8B = Shape("llama-3.1-8b", 128256, 32, 4096, 32, 8, 14336)
TINY = Shape("tiny", 512, 2, 128, 4, 2, 256, 4096)  # the same code, seconds on a CPU
SHAPES = {s.name: s for s in (LLAMA_3_1_8B, TINY)}


@dataclass(frozen=True)
class Plan:
    """What the bench runs: the shape, the adapters, the batches and prompts."""

    shape: Shape
    batches: tuple[int, ...] = (1, 8, 32, 64)
    adapters: int = 16
    rank: int = 16
    targets: tuple[str, ...] = PROJECTIONS
    context: int = 512  # each decoding sequence's prompt
    decode_steps: int = 16  # timed per arm and round, after 2 untimed
    rounds: int = 3  # base and LoRA alternate, each round swapping which goes first
    ttft_prompts: tuple[int, ...] = (2048, 8192, 32768)
    ttft_rounds: int = 2
    prefill_chunk: int = 8192  # engine.max_num_batched_tokens
    element_size: int = 2  # bf16

    @property
    def max_model_len(self) -> int:
        return max(*self.ttft_prompts, self.context + self.decode_steps + DECODE_SLACK) + 64

    def kv_cache_bytes(self) -> int:
        """The KV cache: the longest prompt alone, or the largest batch, whichever needs
        more, plus a quarter for block rounding."""
        per_token = self.shape.kv_bytes_per_token(self.element_size)
        longest = self.context + self.decode_steps + DECODE_SLACK
        tokens = max(self.max_model_len, max(self.batches) * longest)
        return int(tokens * per_token * 1.25)

    def adapter_bytes(self) -> int:
        """One adapter's A and B over every layer and target."""
        s, r = self.shape, self.rank
        kv = s.num_kv_heads * s.head_dim
        shapes = {"q_proj": (s.hidden_size, s.hidden_size), "k_proj": (s.hidden_size, kv),
                  "v_proj": (s.hidden_size, kv), "o_proj": (s.hidden_size, s.hidden_size),
                  "gate_proj": (s.hidden_size, s.intermediate_size),
                  "up_proj": (s.hidden_size, s.intermediate_size),
                  "down_proj": (s.intermediate_size, s.hidden_size)}  # fmt: skip
        per_layer = sum(r * (shapes[t][0] + shapes[t][1]) for t in self.targets)
        return s.num_layers * per_layer * self.element_size

    def engine_config(self, model_dir: Path, device: str) -> dict:
        """The engine's settings (EngineConfig fields) for this plan."""
        return {
            "model": str(model_dir),
            "device": device,
            "load_format": "dummy",
            "max_lora_rank": self.rank,
            "max_num_seqs": max(self.batches),
            "max_num_batched_tokens": self.prefill_chunk,
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": self.kv_cache_bytes(),
            "enable_prefix_caching": False,  # every TTFT computes its whole prompt
            "cuda_graphs": True,
            "adapters": {
                "num_slots": self.adapters + 1,
                "max_loras_per_batch": self.adapters,
                "host_cache_bytes": 2 * self.adapters * self.adapter_bytes() + (64 << 20),
            },
        }

    def memory(self) -> dict[str, int]:
        """Device bytes the plan needs, by what holds them (activations aside)."""
        return {
            "weights": self.shape.weight_bytes(self.element_size)
            + self.shape.vocab_size * self.shape.hidden_size * self.element_size,
            "kv_cache": self.kv_cache_bytes(),
            "adapter_slots": self.adapters * self.adapter_bytes(),
        }


TINY_PLAN = dict(batches=(1, 4), adapters=2, rank=4, context=16, decode_steps=3, rounds=1,
                 ttft_prompts=(32, 64), ttft_rounds=1, prefill_chunk=64)  # fmt: skip


@dataclass
class Figures:
    """What a run measured, keyed as benchmarks/targets.toml and the docs name it."""

    copy_gbps: float = 0.0
    decode: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)
    graphs: dict[str, int] = field(default_factory=dict)
    quant: dict[str, float] = field(default_factory=dict)

    def headline(self) -> dict[str, float]:
        return {**self.decode, **self.ttft, **self.quant}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=list(SHAPES), default=LLAMA_3_1_8B.name,
                   help="The model's shape (tiny: the same measurements in seconds, for a "
                        "CPU check of the code).")  # fmt: skip
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Plan only: shapes, bytes, the validated engine config; no engine.",
    )
    p.add_argument("--json", type=Path, default=None, help="Write every figure here.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quant",
        default="",
        help="Also measure the base held packed in these formats, comma-separated: "
        f"{', '.join(QUANT_FORMATS)} (decode steps at batch 1 and 32 over bf16's).",
    )


def run(args: argparse.Namespace) -> int:
    shape = SHAPES[args.shape]
    formats = _quant_formats(args.quant)  # refused before minutes of building
    plan = Plan(shape) if shape is not TINY else Plan(shape, **TINY_PLAN)
    # a dry run plans for the GPU machine, wherever it runs
    device = args.device or ("cuda" if args.dry_run else _default_device())
    if not device.startswith("cuda"):
        plan = replace(plan, element_size=4)  # the engine's dtype on a CPU: fp32
    with tempfile.TemporaryDirectory(prefix="lorafleet-gpu-bench-") as tmp:
        model_dir = write_model_dir(shape, Path(tmp) / "model")
        config = _validated_config(plan, model_dir, device)
        _print_plan(plan, config, device)
        if args.dry_run:
            return _finish(args, plan, device, None, dry_run=True)
        if not _has_graph_stats():  # before minutes of building: figures need counted graphs
            raise SystemExit("LLMEngine.graph_stats() is missing: graphs must be counted, "
                             "not assumed (only --dry-run goes on without it)")  # fmt: skip
        figures = measure(plan, config, model_dir, Path(tmp) / "adapters", args.seed)
        for fmt in formats:
            qdir = write_model_dir(shape, Path(tmp) / f"model-{fmt}", QUANT_FORMATS[fmt])
            qconfig = _validated_config(plan, qdir, device)
            figures.quant |= measure_packed(fmt, plan, qconfig, qdir, tmp, args.seed, figures)
    return _finish(args, plan, device, figures, dry_run=False)


def write_model_dir(shape: Shape, out: Path, quant: dict | None = None) -> Path:
    """config.json of `shape` (with `quant` as its quantization_config) and a byte-level
    BPE tokenizer (256 bytes, no merges, and begin/end-of-text) in `out`: a Hugging Face
    model directory with no weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")  # fmt: skip
    out.mkdir(parents=True)
    fast.save_pretrained(out)
    config = shape.config(fast.bos_token_id, fast.eos_token_id)
    if quant is not None:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def measure_packed(
    fmt: str, plan: Plan, config: dict, model_dir: Path, tmp: str, seed: int, bf16: Figures
) -> dict[str, float]:
    """The decode figures of the base held packed as `fmt` at batch 1 and the largest
    batch up to 32, and the batch-1 base step's speedup over the bf16 run's."""
    batches = (1, max(b for b in plan.batches if b <= 32))
    packed = replace(plan, batches=batches)
    device = torch.device(config["device"])
    names = [f"gpu-{i:02d}" for i in range(plan.adapters)]
    plans = [AdapterPlan(n, plan.rank, 2 * plan.rank, plan.targets) for n in names]
    paths = write_adapters(model_dir, load_model_spec(model_dir), Path(tmp) / f"a-{fmt}",
                           plans, device=device, dtype=torch.bfloat16, seed=seed)  # fmt: skip
    print(f"{fmt}: the base held packed", flush=True)
    eng = LLMEngine(EngineConfig(**config))
    try:
        for name, path in paths.items():
            eng.load_adapter(name, path)
        decode = _decode(eng, packed, names, random.Random(seed), bf16.copy_gbps * 1e9)
    finally:
        eng.shutdown()
    b = batches[1]
    return {
        f"{fmt}_base_step_ms_b1": decode["base_step_ms_b1"],
        f"{fmt}_speedup_b1": bf16.decode["base_step_ms_b1"] / decode["base_step_ms_b1"],
        f"{fmt}_lora_over_base_step_b{b}": decode[f"lora_over_base_step_b{b}"],
    }


def _quant_formats(names: str) -> list[str]:
    formats = [n for n in names.split(",") if n]
    unknown = [n for n in formats if n not in QUANT_FORMATS]
    if unknown:
        raise SystemExit(f"--quant {unknown[0]!r}: expected some of {', '.join(QUANT_FORMATS)}")
    return formats


def measure(plan: Plan, config: dict, model_dir: Path, adapter_dir: Path, seed: int) -> Figures:
    """Every figure of the module docstring, on one engine."""
    device = torch.device(config["device"])
    figures = Figures(copy_gbps=harness.copy_bandwidth(device, _copy_bytes(device)) / 1e9)
    names = [f"gpu-{i:02d}" for i in range(plan.adapters)]
    plans = [AdapterPlan(n, plan.rank, 2 * plan.rank, plan.targets) for n in names]
    t0 = time.perf_counter()
    paths = write_adapters(model_dir, load_model_spec(model_dir), adapter_dir, plans,
                           device=device, dtype=torch.bfloat16, seed=seed)  # fmt: skip
    eng = LLMEngine(EngineConfig(**config))
    print(
        f"engine ready after {time.perf_counter() - t0:.0f} s (adapters written, weights "
        f"made, graphs captured); copy bandwidth {figures.copy_gbps:.0f} GB/s",
        flush=True,
    )
    try:
        for name, path in paths.items():
            eng.load_adapter(name, path)
        rng = random.Random(seed)
        before = _graph_stats(eng)
        figures.decode = _decode(eng, plan, names, rng, figures.copy_gbps * 1e9)
        after = _graph_stats(eng)
        figures.graphs = {k: after[k] - before[k] for k in GRAPH_KEYS} | {
            "graphs_captured": after["graphs_captured"]
        }
        figures.ttft = _ttft(eng, plan, names[0], rng)
    finally:
        eng.shutdown()
    return figures


def _decode(
    eng: LLMEngine, plan: Plan, names: list[str], rng: random.Random, bandwidth: float
) -> dict:
    """Per batch: base and LoRA step medians (arms alternated), their HBM limits."""
    shape, out = plan.shape, {}
    weights = shape.weight_bytes(plan.element_size)
    for b in plan.batches:
        adapters = [names[i % min(b, len(names))] for i in range(b)]
        prompts = [_prompt(rng, shape, plan.context) for _ in range(b)]
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(plan.rounds):
            for arm in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
                chosen = adapters if arm == "lora" else [None] * b
                runs[arm].append(_decode_step_s(eng, prompts, chosen, plan.decode_steps))
        base, lora = statistics.median(runs["base"]), statistics.median(runs["lora"])
        # the KV every sequence reads, at the timed steps' mean context
        kv = (
            b
            * (plan.context + 2 + plan.decode_steps / 2)
            * shape.kv_bytes_per_token(plan.element_size)
        )
        lora_bytes = len(set(adapters)) * plan.adapter_bytes()
        out |= {
            f"base_step_ms_b{b}": base * 1e3,
            f"lora_step_ms_b{b}": lora * 1e3,
            f"lora_over_base_step_b{b}": lora / base,
            f"hbm_limit_ms_b{b}": (weights + kv) / bandwidth * 1e3,
            f"base_step_over_hbm_limit_b{b}": base / ((weights + kv) / bandwidth),
            f"lora_step_over_hbm_limit_b{b}": lora / ((weights + kv + lora_bytes) / bandwidth),
        }
        print(
            f"  batch {b:>3}: base {base * 1e3:7.2f} ms, LoRA {lora * 1e3:7.2f} ms "
            f"({lora / base:.3f}x), HBM limit {out[f'hbm_limit_ms_b{b}']:.2f} ms",
            flush=True,
        )
    return out


def _decode_step_s(eng: LLMEngine, prompts: list[list[int]], adapters: list, steps: int) -> float:
    """Median seconds of a decode-only step with every sequence in the batch (each step
    ends with the engine's one device read: the time is the device's too)."""
    # the first rows to finish their prefill decode while the last ones prefill: room for it
    sampling = SamplingParams(temperature=0, max_tokens=steps + DECODE_SLACK, ignore_eos=True)
    seqs = [eng.add_request(GenerateRequest(p, sampling, a)) for p, a in zip(prompts, adapters)]
    for _ in range(100_000):  # prefill everything (chunked), adapters loaded
        if all(s.output_ids for s in seqs):
            break
        eng.step()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        eng.step()
        if i >= 2:  # the first two: untimed
            times.append(time.perf_counter() - t0)
    for s in seqs:
        eng.abort(s)
    return statistics.median(times)


def _ttft(eng: LLMEngine, plan: Plan, adapter: str, rng: random.Random) -> dict:
    """Per prompt length: TTFT of one request alone, without and on `adapter` (medians
    of alternated rounds, after an untimed request of each at the shortest length)."""
    out = {}
    shortest = min(plan.ttft_prompts)
    for a in (None, adapter):  # warm: kernels compiled for these shapes, adapter resident
        _ttft_s(eng, _prompt(rng, plan.shape, shortest), a)
    for n in plan.ttft_prompts:
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(plan.ttft_rounds):
            for arm in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
                prompt = _prompt(rng, plan.shape, n)
                runs[arm].append(_ttft_s(eng, prompt, adapter if arm == "lora" else None))
        base, lora = statistics.median(runs["base"]), statistics.median(runs["lora"])
        k = f"{n // 1024}k" if n >= 1024 else str(n)
        out |= {f"ttft_{k}_base_ms": base * 1e3, f"ttft_{k}_lora_ms": lora * 1e3,
                f"ttft_{k}_lora_over_base": lora / base}  # fmt: skip
        print(
            f"  TTFT {n:>6} tokens: base {base * 1e3:8.1f} ms, LoRA {lora * 1e3:8.1f} ms "
            f"({lora / base:.3f}x)",
            flush=True,
        )
    return out


def _ttft_s(eng: LLMEngine, prompt: list[int], adapter: str | None) -> float:
    seq = eng.add_request(
        GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=1), adapter)
    )
    t0 = time.perf_counter()
    for _ in range(100_000):
        eng.step()
        if seq.output_ids:
            break
    ttft = time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    return ttft


def _prompt(rng: random.Random, shape: Shape, n: int) -> list[int]:
    return [rng.randrange(3, shape.vocab_size) for _ in range(n)]


def _graph_stats(eng: LLMEngine) -> dict[str, int]:
    """LLMEngine.graph_stats(): exactly these keys, counted by the engine."""
    stats = eng.graph_stats()
    return {k: int(stats[k]) for k in GRAPH_KEYS}


def _copy_bytes(device: torch.device) -> int:
    return (2 << 30) if device.type == "cuda" else (64 << 20)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _validated_config(plan: Plan, model_dir: Path, device: str) -> dict:
    """The plan's engine config, checked against EngineConfig, the model's spec and, on
    CUDA, the engine's memory plan of an 80 GB GPU (no tensors): a dry run fails where a
    real one would before it starts."""
    config = plan.engine_config(model_dir, device)
    spec = load_model_spec(model_dir)
    if device.startswith("cuda"):
        try:
            memory = plan_memory(spec, EngineConfig(**config), torch.bfloat16, SMALLEST_GPU_BYTES)
        except MemoryPlanError as e:
            raise SystemExit(f"the bench does not fit an 80 GB GPU: {e}") from None
        print(f"  memory plan of an 80 GB GPU: weights {gib(memory.weights_bytes_per_gpu)}, "
              f"KV {gib(memory.kv_cache_bytes)}, adapters {gib(memory.adapter_memory_bytes)}, "
              f"activations {gib(memory.activation_bytes)}, graphs {gib(memory.graph_bytes)}; "
              f"{gib(memory.free_bytes)} of the budget left")  # fmt: skip
    else:
        EngineConfig(**config)
    if (spec.num_layers, spec.hidden_size, spec.vocab_size) != (
        plan.shape.num_layers, plan.shape.hidden_size, plan.shape.vocab_size
    ):  # fmt: skip
        raise SystemExit(f"the written config.json reads as another shape: {spec}")
    return config


def _has_graph_stats() -> bool:
    return callable(getattr(LLMEngine, "graph_stats", None))


def _print_plan(plan: Plan, config: dict, device: str) -> None:
    s, gb = plan.shape, 1e9
    mem = plan.memory()
    print(f"gpu bench on {device}: {s.name} (vocab {s.vocab_size:,}, {s.num_layers} layers, "
          f"hidden {s.hidden_size}, {s.num_heads} heads / {s.num_kv_heads} KV, MLP "
          f"{s.intermediate_size:,}), random {'bf16' if plan.element_size == 2 else 'fp32'} "
          "weights made on the device")  # fmt: skip
    print(
        f"  {plan.adapters} adapters of rank {plan.rank} on {'+'.join(plan.targets)}, "
        f"{plan.adapter_bytes() / gb:.3f} GB each"
    )
    print(
        f"  decode at batch {', '.join(map(str, plan.batches))} over {plan.context}-token "
        f"prompts, {plan.decode_steps} steps x {plan.rounds} rounds per arm; TTFT at "
        f"{', '.join(map(str, plan.ttft_prompts))} tokens (chunks of {plan.prefill_chunk})"
    )
    print(
        f"  device memory: weights {mem['weights'] / gb:.1f} GB, KV cache "
        f"{mem['kv_cache'] / gb:.1f} GB, adapter slots {mem['adapter_slots'] / gb:.1f} GB; "
        f"a decode step reads {s.weight_bytes(plan.element_size) / gb:.2f} GB of weights"
    )
    print(f"  engine: {json.dumps({k: v for k, v in config.items() if k != 'model'})}")


def _finish(
    args: argparse.Namespace, plan: Plan, device: str, figures: Figures | None, dry_run: bool
) -> int:
    """The JSON (--json) and the summary line: the bench's last line."""
    headline = figures.headline() if figures else {}
    checked = harness.check("gpu", headline)
    graphs = figures.graphs if figures else {"graph_stats": _has_graph_stats()}
    if figures is not None:
        for line in harness.verdict_lines(checked):
            print(f"  {line}")
        if figures.graphs.get("graph_replays", 0) == 0 and device.startswith("cuda"):
            print("  no decode step replayed a CUDA graph: these figures are eager steps")
    report = {**harness.run_meta(args), "plan": asdict(plan), "device": device,
              "dry_run": dry_run, "memory": plan.memory(), "graphs": graphs,
              "figures": asdict(figures) if figures else None, "targets": checked}  # fmt: skip
    harness.write_json(args.json, report)
    summary = {"bench": "gpu", "dry_run": dry_run, "device": device, "shape": plan.shape.name,
               "copy_gbps": figures.copy_gbps if figures else None, "figures": headline,
               "graphs": graphs,
               "targets": {k: c["met"] for k, c in checked.items()}}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
