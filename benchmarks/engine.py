"""`python -m benchmarks engine`: the replica engine in-process, scenarios, ablations, a baseline.

Every figure is measured on this machine in this run; each ratio is printed next to the
ceiling the hardware allows, and the targets of benchmarks/targets.toml ([engine]) are
reported met or not after them. `--json PATH` writes all of them.

Churn is real: each churn run's engine gets adapter memory (rank rows, the unit the slot
pool allocates in: an adapter of rank r holds a block of next-pow2(r) rows, at least 8,
in each projection group it targets) of about --memory-share of what its workload's
adapters need together in qkv_proj, the group every demo adapter targets and so the
one they fill first, so adapters are evicted and loaded again; the bench fails if a
churn run evicted nothing. The demo's adapter loads are tiny copies (hidden 512), so
each churn load also sleeps --load-delay-ms after its slot write (the engine's load hook;
by default what copying a rank-16 adapter of a 7B Llama shape costs,
LOAD_DELAY_DEFAULT_MS): the load stall ratios compare loads that cost what real ones do.

`--family` runs the decode-step measurement (decode_step_overhead_vs_bytes) on random-weight
demo-sized models of other families (cluster/demo/families.py), with PEFT adapters of the
same ranks and targets as the demo's written for each model's shapes. On a hybrid
(qwen35) the adapters target the linear attention's projections too, and the base's
bytes count every sequence's linear-attention state, read and written each step. On a mixture of
experts (qwen3moe, mixtral, gptoss) every adapter is an expert adapter: its MLP targets are every
expert's gate/up/down (per-expert keys), and the family also reports prefill and decode
tok/s, base and LoRA.

`--quant FORMAT,...` runs instead the decode step of the demo model held packed in each
format against the same model dense (benchmarks/quant_engine.py).

    python -m benchmarks engine --json engine.json   # ~8 minutes on 2 CPU cores
    python -m benchmarks engine --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from benchmarks import harness, quant_engine
from benchmarks.adapters import AdapterPlan, write_adapters
from cluster.bench.stats import ms, percentile
from cluster.demo.assets import DemoAssets, DemoSpec, adapter_plans, cached_demo_assets
from cluster.demo.families import family_model_dir
from replica.adapters.memory import config_slot_bytes
from replica.config import EngineConfig
from replica.device import resolve_device, resolve_dtype
from replica.engine.engine import LLMEngine
from replica.engine.sequence import Sequence
from replica.model.adapter_weights import LoRAAdapterWeights
from replica.model.hybrid import LINEAR_MODULES
from replica.model.lora_slots import block_rows
from replica.model.peft_config import peft_config_rank
from replica.model.spec import MLP_MODULES, ModelSpec, load_model_spec
from replica.wire import GenerateRequest, SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    adapters: list[str | None]
    max_tokens: int
    concurrency: int


@dataclass
class EngineRun:
    """What one in-process engine run of a workload measured."""

    name: str
    tok_per_s: float
    wall_s: float
    ttft: dict[str, list[float]] = field(default_factory=dict)  # "base" / "adapter" -> seconds
    e2e: dict[str, list[float]] = field(default_factory=dict)
    adapter_loads: int = 0
    load_wait_s: float = 0.0
    prefetch_overhead_s: float = 0.0
    evictions: int = 0
    churn: Churn | None = None  # the memory pressure and load delay of a churn run

    def summary(self) -> dict:
        out = {
            "tok_per_s": self.tok_per_s,
            "wall_s": self.wall_s,
            "adapter_loads": self.adapter_loads,
            "load_wait_s": self.load_wait_s,
            "prefetch_overhead_s": self.prefetch_overhead_s,
            "evictions": self.evictions,
        }
        if self.churn is not None:
            out.update(self.churn.summary())
        for metric, values in (("ttft", self.ttft), ("e2e", self.e2e)):
            for kind, xs in values.items():
                if xs:
                    out[f"{metric}_{kind}_p50_s"] = percentile(xs, 50)
                    out[f"{metric}_{kind}_p95_s"] = percentile(xs, 95)
        return out


@dataclass(frozen=True)
class Churn:
    """A churn run's adapter memory: `memory_rows` rank rows (`memory_bytes` on this
    device) for a workload whose adapters need `working_set_rows` together, and the delay
    each adapter load sleeps."""

    memory_rows: int
    working_set_rows: int
    memory_bytes: int
    load_delay_ms: float

    def summary(self) -> dict:
        return {
            "adapter_memory_rows": self.memory_rows,
            "working_set_rows": self.working_set_rows,
            "adapter_memory_bytes": self.memory_bytes,
            "load_delay_ms": self.load_delay_ms,
        }


SCENARIOS = ("uniform", "zipf", "distinct", "mixed", "base_only")
# the runs that must evict (the plain scenarios with adapters, and the ablations of them)
CHURN_RUNS = ("uniform", "zipf", "distinct", "mixed", "distinct_sync_loading",
              "mixed_base_unpinned", "distinct_spare_slot", "distinct_spare_slot_sync")  # fmt: skip
# What a real adapter load costs, for the demo's tiny ones: copying a rank-16 adapter on
# all seven projections of a 7B Llama shape (hidden 4096, MLP 11008, 32 layers; fp16) at
# LOAD_DELAY_GBPS, a host->device copy over PCIe (4.0 x16 peaks at ~25 GB/s pinned).
LOAD_DELAY_RANK, LOAD_DELAY_GBPS = 16, 10.0
LOAD_DELAY_BYTES = LOAD_DELAY_RANK * 32 * (4 * (4096 + 4096) + 3 * (4096 + 11008)) * 2
LOAD_DELAY_DEFAULT_MS = LOAD_DELAY_BYTES / (LOAD_DELAY_GBPS * 1e9) * 1e3  # ~8.0 ms
LOAD_DELAY_HOW = (
    "slept after each adapter's slot write (the copy into device memory; the engine's "
    "load hook): on the loader thread with overlapped loading, inside the step with sync "
    "loading; churn runs only"
)
FAMILIES = ("llama", "qwen3", "gemma2", "qwen3moe", "mixtral", "gptoss", "qwen35", "gemma4")
MOE_FAMILIES = ("qwen3moe", "mixtral", "gptoss")


def _share(text: str) -> float:
    share = float(text)
    if not 0 < share < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a share in (0, 1)")
    return share


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=int, default=16, help="Distinct adapters in the workload.")
    p.add_argument("--requests", type=int, default=64, help="Requests per scenario.")
    p.add_argument("--concurrency", type=int, default=32, help="Requests in flight at once.")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slots", type=int, default=8,
                   help="Distinct adapters one batch may hold in churn scenarios.")  # fmt: skip
    p.add_argument("--memory-share", type=_share, default=0.5,
                   help="Adapter memory of a churn run, as a share of the rank rows its "
                        "workload's adapters need together (rounded to whole blocks of "
                        "max_lora_rank, below the whole), so that they evict.")  # fmt: skip
    p.add_argument("--load-delay-ms", type=float, default=LOAD_DELAY_DEFAULT_MS,
                   help="Sleep this long in every adapter load of the churn runs (default: "
                        f"a rank-{LOAD_DELAY_RANK} adapter of a 7B Llama shape, "
                        f"{LOAD_DELAY_BYTES / 1e6:.0f} MB fp16, copied at "
                        f"{LOAD_DELAY_GBPS:.0f} GB/s); 0: the demo's own small loads.")  # fmt: skip
    p.add_argument("--family", type=harness.subset_of(FAMILIES), default=("llama",),
                   metavar="NAME,...",
                   help=f"Model families, of {', '.join(FAMILIES)}: llama runs the whole "
                        "bench on the demo model; each other runs the decode-step "
                        "measurement (decode_step_overhead_vs_bytes) on a random-weight "
                        "demo-sized model of its family; with several, one line each.")  # fmt: skip
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--baseline-requests", type=int, default=32,
                   help="Requests timed through transformers + PEFT.")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="Tensor-parallel ranks of every engine (a local Ray starts for N > 1); "
                        "adds the per-step communication volume.")  # fmt: skip
    p.add_argument("--scenarios", type=harness.subset_of(SCENARIOS), default=None,
                   metavar="NAME,...",
                   help=f"Run only these of {', '.join(SCENARIOS)}: their table rows, "
                        "without the ablations, the transformers + PEFT baseline and the "
                        "headline figures (which need every scenario); the --tp "
                        "section still runs.")  # fmt: skip
    p.add_argument("--quant", type=harness.subset_of(quant_engine.FORMATS), default=(),
                   metavar="FORMAT,...",
                   help=f"Only the decode step of the demo model held packed in these of "
                        f"{', '.join(quant_engine.FORMATS)} (dummy weights), against it "
                        "dense: weight bytes, batch-1 and batch steps, LoRA overhead.")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="A few-second smoke run.")
    p.add_argument("--json", type=Path, default=None, help="Write every figure here.")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    owns_ray = args.tp > 1 and not ray.is_initialized()
    if owns_ray:  # for the rank actors; a Ray started here stops with the bench
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        return _bench(args)
    finally:
        if owns_ray:
            ray.shutdown()


def _bench(args: argparse.Namespace) -> int:
    if args.quick:
        # 8 adapters (ranks 8-64, 240 rank rows): every churn run's working set exceeds
        # its memory, the spare-block ablation's included
        args.adapters, args.requests, args.concurrency = 8, 8, 4
        args.prompt_len, args.output_len, args.slots, args.baseline_requests = 16, 8, 3, 2
    torch.manual_seed(args.seed)
    report: dict = {**harness.run_meta(args), "args": _jsonable(vars(args))}
    failures: list[str] = []
    if args.quant:
        report["quant"] = quant_engine.run(args, _decode_step, _base_decode_step)
        harness.write_json(args.json, report)
        return 0
    if "llama" in args.family:
        failures = _llama_bench(args, report)
    if args.family != ("llama",):
        report["families"] = _families(args, report)
        _print_families(report["families"], args)
    harness.write_json(args.json, report)
    if failures:
        print("benchmarks engine: FAILED, churn without eviction (the memory budget did not "
              "force any adapter out, so these runs measured first loads only):\n  "
              + "\n  ".join(failures), file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _llama_bench(args: argparse.Namespace, report: dict) -> list[str]:
    """The scenarios, ablations and headline on the demo Llama, into `report`; printed.
    Returns a line per churn run that evicted nothing."""
    assets = cached_demo_assets(DemoSpec(num_adapters=args.adapters))
    names = list(assets.adapters)
    rng = random.Random(args.seed)
    vocab = DemoSpec().vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]

    def workload(name: str, pick) -> Workload:
        chosen = [pick(i) for i in range(args.requests)]
        return Workload(name, prompts, chosen, args.output_len, args.concurrency)

    zipf = _zipf_weights(len(names), args.zipf_alpha)
    scenarios = {
        "uniform": workload("uniform", lambda i: rng.choice(names)),
        "zipf": workload("zipf", lambda i: rng.choices(names, zipf)[0]),
        "distinct": workload("distinct", lambda i: names[i % len(names)]),
        "mixed": workload("mixed", lambda i: None if i % 2 else names[(i // 2) % len(names)]),
        "base_only": workload("base_only", lambda i: None),
    }
    base_cfg = dict(model=str(assets.model_dir), device="auto", max_num_seqs=args.concurrency,
                    kv_cache_bytes=_kv_bytes(args), max_model_len=_max_model_len(args),
                    tp_size=args.tp)  # fmt: skip
    residency = {"num_slots": args.adapters + 1, "max_loras_per_batch": args.adapters}
    fits = dict(base_cfg, adapters=residency)
    pressure = _ChurnMemory(assets, base_cfg, args)
    report["churn"] = {
        "memory_share": args.memory_share,
        "max_loras_per_batch": args.slots,
        "load_delay_ms": args.load_delay_ms,
        "load_delay_how": LOAD_DELAY_HOW,
        "load_delay_model": f"rank-{LOAD_DELAY_RANK} adapter on all 7 projections of a 7B "
        f"Llama shape (hidden 4096, MLP 11008, 32 layers, fp16): {LOAD_DELAY_BYTES} bytes "
        f"at {LOAD_DELAY_GBPS} GB/s",
    }
    report["scenarios"] = {}

    print(
        f"engine bench: {args.requests} requests x {args.prompt_len}+{args.output_len} tokens, "
        f"{args.concurrency} concurrent, {args.adapters} adapters"
        + (f", tp_size {args.tp}" if args.tp > 1 else "")
    )
    print(
        f"churn: adapter memory ~{args.memory_share:.0%} of the rank rows each run's adapters "
        f"need (whole {pressure.top}-row blocks; 'mem rows' below), at most {args.slots} "
        f"adapters per batch; every load sleeps {args.load_delay_ms:.1f} ms ("
        + (
            f"a rank-{LOAD_DELAY_RANK} 7B-shape adapter, {LOAD_DELAY_BYTES / 1e6:.0f} MB fp16, "
            f"at {LOAD_DELAY_GBPS:.0f} GB/s"
            if args.load_delay_ms == LOAD_DELAY_DEFAULT_MS
            else "--load-delay-ms"
        )
        + f"), {LOAD_DELAY_HOW}"
    )
    results = {}
    for name in args.scenarios or SCENARIOS:
        wl = scenarios[name]
        results[name] = run_workload(
            EngineConfig(**pressure.config(wl)), assets, wl, pressure.churn(wl)
        )
    if args.scenarios is None:
        _ablations(results, scenarios, assets, pressure, fits)
    for name, r in results.items():
        report["scenarios"][name] = r.summary()
    _print_table(results)
    if args.scenarios is None:
        _headline(report, results, scenarios, assets, args, fits)
    if args.tp > 1:
        report["tp_comm"] = _tp_comm(assets, min(16, args.adapters), args)
        _print_tp_comm(report["tp_comm"])
    return [
        f"{name}: 0 evictions in {r.adapter_loads} loads, {r.churn.working_set_rows} rank "
        f"rows of adapters in {r.churn.memory_rows} rows of memory"
        + (
            " (the memory holds them all: more adapters or requests make a larger working set)"
            if r.churn.memory_rows >= r.churn.working_set_rows
            else ""
        )
        for name, r in results.items()
        if name in CHURN_RUNS and r.churn is not None and r.evictions == 0
    ]


class _ChurnMemory:
    """Engine settings of the churn runs: adapter memory of about args.memory_share of the
    rank rows the workload's adapters need together in qkv_proj (block_rows of each: all
    of them target q_proj and v_proj; the other groups' arenas, as large, hold fewer of
    them), in whole blocks
    of max_lora_rank (the unit replica/adapters/memory.py sizes the arenas in) and less
    than the whole when a block can be spared, given as engine.adapters.adapter_memory_bytes."""

    def __init__(self, assets, base_cfg: dict, args: argparse.Namespace) -> None:
        self.base_cfg, self.args = base_cfg, args
        self.ranks = {name: _adapter_rank(path) for name, path in assets.adapters.items()}
        config = EngineConfig(**base_cfg)
        self.top = block_rows(config.max_lora_rank)
        dtype = resolve_dtype(config.dtype, resolve_device(config.device))
        # bytes of one rank row on one rank: slot_bytes is linear in its rows
        self.row_bytes = config_slot_bytes(config, load_model_spec(assets.model_dir), 1, dtype)

    def working_set(self, wl: Workload) -> int:
        return sum(block_rows(self.ranks[a]) for a in dict.fromkeys(wl.adapters) if a)

    def rows(self, wl: Workload) -> int:
        need = self.working_set(wl)
        rows = self.top * max(1, round(need * self.args.memory_share / self.top))
        while rows >= need and rows > self.top:
            rows -= self.top
        return rows

    def churn(self, wl: Workload, extra_rows: int = 0) -> Churn:
        rows = self.rows(wl) + extra_rows
        return Churn(rows, self.working_set(wl), rows * self.row_bytes, self.args.load_delay_ms)

    def config(self, wl: Workload, extra_rows: int = 0, **residency) -> dict:
        """EngineConfig values for `wl` under churn; `residency`: more engine.adapters keys."""
        memory = self.churn(wl, extra_rows).memory_bytes
        adapters = {"adapter_memory_bytes": memory, "max_loras_per_batch": self.args.slots}
        return dict(self.base_cfg, adapters=adapters | residency)


def _adapter_rank(path: Path) -> int:
    """The largest rank a PEFT adapter_config.json gives a module (r, or rank_pattern's)."""
    return peft_config_rank(json.loads((Path(path) / "adapter_config.json").read_text()))


def _ablations(
    results: dict[str, EngineRun],
    scenarios: dict[str, Workload],
    assets,
    pressure: _ChurnMemory,
    fits: dict,
) -> None:
    """The runs besides the plain scenarios: all adapters resident, sync loading, the base
    slot unpinned (under the same memory pressure as the scenario they vary), a spare
    max-rank block for prefetch (with and without overlapped loading)."""
    distinct, mixed = scenarios["distinct"], scenarios["mixed"]

    def churn_run(wl: Workload, extra_rows: int = 0, **residency) -> EngineRun:
        cfg = EngineConfig(**pressure.config(wl, extra_rows, **residency))
        return run_workload(cfg, assets, wl, pressure.churn(wl, extra_rows))

    results["all_resident_uniform"] = run_workload(
        EngineConfig(**fits), assets, scenarios["uniform"]
    )
    results["distinct_sync_loading"] = churn_run(distinct, adapter_loading="sync")
    results["mixed_base_unpinned"] = churn_run(mixed, pin_base_slot=False)
    # one max-rank block more than the plain run: the prefetcher can load the next
    # cohort's first adapter while the batch runs (with none spare, every next load
    # starts only when the batch drains; the distinct scenario's requests all end in the
    # same step)
    results["distinct_spare_slot"] = churn_run(distinct, pressure.top)
    results["distinct_spare_slot_sync"] = churn_run(distinct, pressure.top, adapter_loading="sync")


def _headline(
    report: dict,
    results: dict[str, EngineRun],
    scenarios: dict[str, Workload],
    assets,
    args: argparse.Namespace,
    fits: dict,
) -> None:
    """The baseline, the decode-step and mixed-sampling measurements and the ratios of
    the headline, into `report`; printed."""
    # The machine's speed drifts (shared VM, up to 1.4x between minutes): the baseline's
    # halves are timed between runs of ours, so drift hits both sides alike.
    runs = [results["all_resident_uniform"].tok_per_s]

    def run_ours() -> None:
        runs.append(run_workload(EngineConfig(**fits), assets, scenarios["uniform"]).tok_per_s)

    baseline = _hf_peft_baseline(
        assets, scenarios["uniform"], args.baseline_requests, between=run_ours
    )
    run_ours()
    report["hf_peft_baseline"] = baseline
    report["all_resident_uniform_tok_per_s_runs"] = runs
    report["speedup_vs_hf_peft"] = statistics.mean(runs) / baseline["tok_per_s"]
    batch_step = _base_decode_step(assets, args)
    report["decode_step_base_full_batch_s"] = batch_step
    report["speedup_ceiling_estimate"] = _ceiling(baseline, scenarios["uniform"], batch_step)
    on = results["distinct"].load_wait_s
    off = results["distinct_sync_loading"].load_wait_s
    report["load_stall_ratio_overlap_on_vs_off"] = on / off if off else float("nan")
    on, off = (results[k].load_wait_s for k in ("distinct_spare_slot", "distinct_spare_slot_sync"))
    report["load_stall_ratio_with_spare_slot"] = on / off if off else float("nan")
    base_only = percentile(results["base_only"].ttft["base"], 50)
    report["base_ttft_p50_ratio_churn_vs_base_only"] = (
        percentile(results["mixed"].ttft["base"], 50) / base_only
    )
    report["base_ttft_p50_ratio_unpinned_vs_base_only"] = (
        percentile(results["mixed_base_unpinned"].ttft["base"], 50) / base_only
    )
    report.update(_decode_step(assets, min(16, args.adapters), args))
    report["mixed_sampling"] = _mixed_sampling(EngineConfig(**fits), assets, scenarios["uniform"])
    report["decode_tok_per_s_ratio_mixed_vs_plain_sampling"] = report["mixed_sampling"]["ratio"]
    # the same ceiling with each decode step paying the measured cost of reading 16
    # adapters (prefill's LoRA work still counted free): what batching can reach here
    lora_step = report["decode_step_16_adapters_s"] - report["decode_step_base_s"]
    report["speedup_ceiling_with_lora_decode"] = _ceiling(
        baseline, scenarios["uniform"], batch_step + max(0.0, lora_step)
    )
    report["targets"] = harness.check("engine", report)
    _print_headline(report)


# -- one engine run -----------------------------------------------------------------------------


def run_workload(
    config: EngineConfig, assets, wl: Workload, churn: Churn | None = None
) -> EngineRun:
    """`wl` driven through a fresh engine of `config` with every adapter of `assets`
    registered, `concurrency` requests in flight; what it measured."""
    eng = LLMEngine(config)
    try:
        for name, path in assets.adapters.items():
            eng.load_adapter(name, path)  # validated into the host cache, not into slots
        if churn is not None and churn.load_delay_ms > 0:
            eng.set_load_hook(_sleep_after_load(churn.load_delay_ms / 1e3))
        result = _drive(eng, wl)
        result.churn = churn
        return result
    finally:
        eng.shutdown()


def _sleep_after_load(delay_s: float) -> Callable[[LoRAAdapterWeights], None]:
    """A load hook sleeping `delay_s` after each adapter's slot write (the unpinned base
    model's rank-0 "load" copies nothing and is not delayed)."""

    def sleep(adapter: LoRAAdapterWeights) -> None:
        if adapter.rank > 0:
            time.sleep(delay_s)

    return sleep


def _drive(eng: LLMEngine, wl: Workload) -> EngineRun:
    sampling = SamplingParams(temperature=0, max_tokens=wl.max_tokens, ignore_eos=True)
    pending = list(zip(wl.prompts, wl.adapters))[::-1]
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: list[tuple[Sequence, float]] = []
    live: list[Sequence] = []
    start = time.perf_counter()
    for _ in range(1_000_000):  # bounded: every step makes progress or loads land
        while pending and len(live) < wl.concurrency:
            prompt, adapter = pending.pop()
            seq = eng.add_request(GenerateRequest(prompt, sampling, adapter))
            arrival[seq.request_id] = time.perf_counter()
            live.append(seq)
        if not live:
            break
        for group in eng.step():
            now = time.perf_counter()
            first.setdefault(group.request.request_id, now)
            if group.finished:
                live.remove(group.first)
                done.append((group.first, now))
    wall = time.perf_counter() - start
    result = EngineRun(wl.name, sum(len(s.output_ids) for s, _ in done) / wall, wall)
    for seq, end in done:
        kind = "base" if seq.request.adapter is None else "adapter"
        result.ttft.setdefault(kind, []).append(first[seq.request_id] - arrival[seq.request_id])
        result.e2e.setdefault(kind, []).append(end - arrival[seq.request_id])
    result.adapter_loads = eng.adapters.prefetcher.loads_started
    result.load_wait_s = eng.load_wait_seconds
    result.prefetch_overhead_s = eng.telemetry.stats.prefetch_seconds
    result.evictions = eng.adapters.pool.num_evictions
    return result


# -- the baseline a user would write without us -------------------------------------------------


def _hf_peft_baseline(
    assets, wl: Workload, n: int, between: Callable[[], None] | None = None
) -> dict:
    """transformers + PEFT, one request at a time, switching adapters per request;
    `between()`, untimed, after the first half of the requests."""
    try:
        from peft import PeftModel
    except ImportError as e:  # peft is a test/bench extra
        raise SystemExit("bench engine needs peft: pip install 'lorafleet[test]'") from e
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32).eval()
    names = [a for a in dict.fromkeys(wl.adapters[:n]) if a is not None]
    model = PeftModel.from_pretrained(base, assets.adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(assets.adapters[name], adapter_name=name)
    prefill_s, tokens, untimed, start = 0.0, 0, 0.0, time.perf_counter()
    with torch.inference_mode():
        for i, (prompt, adapter) in enumerate(zip(wl.prompts[:n], wl.adapters[:n])):
            if between is not None and i == n // 2:
                t0 = time.perf_counter()
                between()
                untimed += time.perf_counter() - t0
            model.set_adapter(adapter)
            ids = torch.tensor([prompt])
            t0 = time.perf_counter()
            model(input_ids=ids)
            prefill_s += time.perf_counter() - t0
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=wl.max_tokens, min_new_tokens=wl.max_tokens, pad_token_id=0,
            )  # fmt: skip
            tokens += out.shape[1] - len(prompt)
    wall = time.perf_counter() - start - prefill_s - untimed  # the extra prefill only times it
    per_request = wall / n
    prefill = prefill_s / n
    return {
        "requests": n,
        "tok_per_s": tokens / wall,
        "s_per_request": per_request,
        "prefill_s_per_request": prefill,
        "decode_s_per_token": (per_request - prefill) / wl.max_tokens,
    }


def _ceiling(baseline: dict, wl: Workload, batch_step_s: float) -> float:
    """Best speedup over the baseline if LoRA cost nothing: every prompt prefilled at the
    baseline's speed (prefill is compute-bound either way) and every decode step costing
    a measured base-only decode step of the whole batch (on a CPU that is compute-bound
    too at batch 32, so batching is not free)."""
    batches = -(-len(wl.prompts) // wl.concurrency)
    ideal = len(wl.prompts) * baseline["prefill_s_per_request"]
    ideal += batches * wl.max_tokens * batch_step_s
    return len(wl.prompts) * baseline["s_per_request"] / ideal


def _base_decode_step(assets, args: argparse.Namespace, **overrides) -> float:
    """Median base-only decode step with `concurrency` sequences in the batch."""
    cfg = EngineConfig(model=str(assets.model_dir), device="auto", tp_size=args.tp,
                       max_num_seqs=args.concurrency, kv_cache_bytes=_kv_bytes(args),
                       max_model_len=_max_model_len(args), **overrides)  # fmt: skip
    eng = LLMEngine(cfg)
    try:
        rng = random.Random(2)
        prompts = [
            [rng.randrange(3, 2000) for _ in range(args.prompt_len)]
            for _ in range(args.concurrency)
        ]
        return _steady_decode_step(eng, prompts, [None] * args.concurrency)
    finally:
        eng.shutdown()


# -- decode step cost with 16 distinct adapters vs base ------------------------------------------


DECODE_ROUNDS = 3


def _decode_step(
    assets, n_adapters: int, args: argparse.Namespace, kv_bytes: int | None = None, **overrides
) -> dict:
    kv_bytes = _kv_bytes(args) if kv_bytes is None else kv_bytes
    eng, names = _batch_engine(assets, n_adapters, args, kv_bytes, **overrides)
    try:
        prompts = _prompts(names, args, seed=1)
        base_runs, lora_runs = [], []
        for _ in range(DECODE_ROUNDS):  # alternated, so drift in machine speed hits both
            base_runs.append(_steady_decode_step(eng, prompts, [None] * len(names)))
            lora_runs.append(_steady_decode_step(eng, prompts, names))
        base_s, lora_s = statistics.median(base_runs), statistics.median(lora_runs)
        base_bytes = sum(t.nbytes for t in eng.executor.model.step_weights())
        linear = eng.spec.linear_attention
        if linear is not None:  # a hybrid's state rows, read and written by every decode
            base_bytes += 2 * len(names) * linear.state_bytes_per_seq(eng.dtype)
        lora_bytes = sum(_step_bytes(eng.adapters.host_cache.get(n), eng.spec) for n in names)
    finally:
        eng.shutdown()
    step_ratio = lora_s / base_s
    bytes_ratio = (base_bytes + lora_bytes) / base_bytes
    return {
        "decode_step_base_s": base_s,
        "decode_step_16_adapters_s": lora_s,
        "decode_step_ratio_16_adapters_vs_base": step_ratio,
        "decode_bytes_ratio_16_adapters_vs_base": bytes_ratio,
        "decode_step_overhead_vs_bytes": step_ratio / bytes_ratio,
        "decode_batch": len(names),
        "decode_weight_bytes": base_bytes,
    }


def _batch_engine(
    assets, n_adapters: int, args: argparse.Namespace, kv_bytes: int, **overrides
) -> tuple[LLMEngine, list[str]]:
    """An engine whose one batch holds `n_adapters` sequences, each on its own adapter: the
    first `n_adapters` of `assets`, loaded (their names returned). The caller shuts it down."""
    names = list(assets.adapters)[:n_adapters]
    residency = {"num_slots": n_adapters + 1, "max_loras_per_batch": n_adapters}
    cfg = EngineConfig(model=str(assets.model_dir), device="auto", adapters=residency,
                       max_num_seqs=n_adapters, kv_cache_bytes=kv_bytes,
                       max_model_len=_max_model_len(args), tp_size=args.tp,
                       **overrides)  # fmt: skip
    eng = LLMEngine(cfg)
    try:
        for name in names:
            eng.load_adapter(name, assets.adapters[name])
    except BaseException:
        eng.shutdown()
        raise
    return eng, names


def _prompts(names: list[str], args: argparse.Namespace, seed: int) -> list[list[int]]:
    """A random prompt of --prompt-len token ids per name."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(args.prompt_len)] for _ in names]


def _step_bytes(adapter: LoRAAdapterWeights, spec: ModelSpec) -> int:
    """Bytes of `adapter` one decode token reads: all of it, but of its expert LoRA only
    the k of E experts the token is routed to. (The base side counts every expert: 16
    tokens routed top-2 of 8 leave each expert idle with probability (6/8)^16 = 1%.)"""
    total = 0
    for (_, module), (a, b) in adapter.weights.items():
        share = spec.num_experts_per_tok / spec.num_experts if module.startswith("expert_") else 1
        total += int((a.nbytes + b.nbytes) * share)
    return total


def _steady_decode_step(eng: LLMEngine, prompts, adapters, steps: int = 12) -> float:
    """Median time of a decode-only step with every sequence in the batch."""
    sampling = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    seqs = [eng.add_request(GenerateRequest(p, sampling, a)) for p, a in zip(prompts, adapters)]
    for _ in range(10_000):  # prefill everything, wait for loads
        eng.step()
        if all(s.output_ids for s in seqs):
            break
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for s in seqs:
        eng.abort(s)
    return statistics.median(times)


# -- the decode step on other model families ----------------------------------------------------


def _families(args: argparse.Namespace, report: dict) -> dict:
    """Per family of args.family: the decode-step figures of `_decode_step` (llama's are
    the headline's when it ran), with as many adapters as the headline uses."""
    n = min(16, args.adapters)
    out = {}
    for family in args.family:
        if family == "llama":
            if "decode_step_overhead_vs_bytes" in report:
                figures = {k: report[k] for k in _DECODE_KEYS}
            else:
                assets = cached_demo_assets(DemoSpec(num_adapters=args.adapters))
                figures = _decode_step(assets, n, args)
            out[family] = {"model": "demo (cluster/demo/assets.py)", **figures}
            continue
        model_dir = family_model_dir(family, size="demo")
        spec = load_model_spec(model_dir)
        experts = {"lora_experts": True} if spec.num_experts else {}  # expert adapters
        with tempfile.TemporaryDirectory(prefix=f"lorafleet-bench-{family}-") as tmp:
            assets = family_adapters(model_dir, spec, Path(tmp), n)
            figures = _decode_step(assets, n, args, _kv_bytes(args, spec), **experts)
            if family in MOE_FAMILIES:
                kv_bytes = _kv_bytes(args, spec)
                figures |= _moe_throughput(assets, n, args, kv_bytes, figures, **experts)
        out[family] = {"model": f"family_model_dir({family!r}, size='demo')", **figures}
    for family, figures in out.items():
        figures["targets"] = harness.check(
            "engine_moe" if family in MOE_FAMILIES else "engine", figures
        )
    return out


_DECODE_KEYS = ("decode_step_base_s", "decode_step_16_adapters_s",
                "decode_step_ratio_16_adapters_vs_base", "decode_bytes_ratio_16_adapters_vs_base",
                "decode_step_overhead_vs_bytes", "decode_batch")  # fmt: skip


def family_adapters(model_dir: Path, spec: ModelSpec, out: Path, n: int) -> DemoAssets:
    """`n` PEFT adapters for the model at `model_dir` (shapes from `spec`), written under
    `out`: the demo's ranks, alphas and targets (cluster/demo/assets.py), and on a mixture
    of experts every expert's MLP projections too. Deterministic."""
    plans = []
    for name, r, alpha, targets, rslora in adapter_plans(DemoSpec(num_adapters=n)):
        if spec.num_experts:  # an expert adapter: every expert's MLP projections too
            targets = tuple(dict.fromkeys((*targets, *MLP_MODULES)))
        if spec.linear_attention is not None:  # a hybrid: its linear attention's too
            targets = tuple(dict.fromkeys((*targets, *LINEAR_MODULES)))
        plans.append(AdapterPlan(name, r, alpha, targets, rslora))
    return DemoAssets(out, model_dir, write_adapters(model_dir, spec, out, plans))


def _moe_throughput(
    assets: DemoAssets,
    n_adapters: int,
    args: argparse.Namespace,
    kv_bytes: int,
    decode: dict,
    **overrides,
) -> dict:
    """Prefill tok/s of `n_adapters` prompts of --prompt-len, base and each on its own
    expert adapter (rounds alternated, medians); decode tok/s from the decode-step medians.
    `overrides`: more EngineConfig values (lora_experts)."""
    budget = n_adapters * args.prompt_len  # every prompt prefilled in one step
    eng, names = _batch_engine(
        assets, n_adapters, args, kv_bytes, max_num_batched_tokens=budget, **overrides
    )
    try:
        prompts = _prompts(names, args, seed=3)
        _prefill_s(eng, prompts, names)  # warm: every adapter in its slot
        base, lora = [], []
        for _ in range(DECODE_ROUNDS):
            base.append(_prefill_s(eng, prompts, [None] * len(names)))
            lora.append(_prefill_s(eng, prompts, names))
    finally:
        eng.shutdown()
    tokens = len(names) * args.prompt_len
    batch = decode["decode_batch"]
    return {
        "prefill_tok_s_base": tokens / statistics.median(base),
        "prefill_tok_s_lora": tokens / statistics.median(lora),
        "decode_tok_s_base": batch / decode["decode_step_base_s"],
        "decode_tok_s_lora": batch / decode["decode_step_16_adapters_s"],
    }


def _prefill_s(eng: LLMEngine, prompts, adapters) -> float:
    """Seconds to prefill every prompt (one step when the token budget holds them all)."""
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seqs = [eng.add_request(GenerateRequest(p, sampling, a)) for p, a in zip(prompts, adapters)]
    t0 = time.perf_counter()
    for _ in range(10_000):
        eng.step()
        if all(s.output_ids for s in seqs):
            break
    return time.perf_counter() - t0


def _print_families(families: dict, args: argparse.Namespace) -> None:
    n = min(16, args.adapters)
    print(f"\ndecode_step_overhead_vs_bytes by family (demo size, batch {n} over {n} adapters "
          "vs base only; ceiling 1.0):")  # fmt: skip
    for family, r in families.items():
        target = r["targets"]["decode_step_overhead_vs_bytes"]
        print(f"  {family:<8} {r['decode_step_overhead_vs_bytes']:.3f}  (target "
              f"{target['target']}: {harness.met_word(target['met'])}; step ratio "
              f"{r['decode_step_ratio_16_adapters_vs_base']:.3f} vs bytes ratio "
              f"{r['decode_bytes_ratio_16_adapters_vs_base']:.3f}; base step "
              f"{ms(r['decode_step_base_s'], 1)} ms)")  # fmt: skip
        if "prefill_tok_s_base" in r:
            print(f"           prefill tok/s base {r['prefill_tok_s_base']:.0f}, LoRA "
                  f"{r['prefill_tok_s_lora']:.0f}; decode tok/s base "
                  f"{r['decode_tok_s_base']:.0f}, LoRA {r['decode_tok_s_lora']:.0f} "
                  "(every adapter on the experts)")  # fmt: skip


# -- sampling features: half the rows with penalties + logprobs vs all plain ---------------------


# what the "mixed" arm's every other row asks for; the rest stay plain (SamplingParams.plain)
MIXED_SAMPLING = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                      logprobs=5)  # fmt: skip


def _mixed_sampling(config: EngineConfig, assets, wl: Workload, steps: int = 16) -> dict:
    """Decode tok/s of one batch (wl's first `concurrency` requests: its prompts and adapters,
    ignore_eos, max_tokens that many decode steps past the prefill, so every length is fixed)
    with every row plain, against the same batch with every other row using repetition /
    presence / frequency penalties and 5 logprobs. Greedy in both arms: the cheapest plain
    row (an argmax), so the ratio is the strictest (a seeded draw would add the same cost to
    both arms), and the bench's other scenarios decode greedily too. One engine; the arms
    alternate, each round swapping which goes first, so the machine's drift hits both; a
    run's figure is its median decode step, an arm's the median of its DECODE_ROUNDS runs."""
    n = min(wl.concurrency, len(wl.prompts))
    batch = list(zip(wl.prompts[:n], wl.adapters[:n]))
    max_tokens = 1 + max(1, min(steps, wl.max_tokens - 1))
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    special = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                             **MIXED_SAMPLING)  # fmt: skip
    arms = {"plain": [plain] * n, "mixed": [special if i % 2 == 0 else plain for i in range(n)]}
    runs: dict[str, list[float]] = {"plain": [], "mixed": []}
    eng = LLMEngine(config)
    try:
        for name in dict.fromkeys(a for a in wl.adapters[:n] if a is not None):
            eng.load_adapter(name, assets.adapters[name])
        for r in range(DECODE_ROUNDS):
            for arm in ("plain", "mixed") if r % 2 == 0 else ("mixed", "plain"):
                runs[arm].append(_decode_tok_per_s(eng, batch, arms[arm]))
    finally:
        eng.shutdown()
    plain_tps, mixed_tps = statistics.median(runs["plain"]), statistics.median(runs["mixed"])
    return {
        "batch": n,
        "max_tokens": max_tokens,
        "sampling": "greedy",
        "mixed_rows": n - n // 2,
        "mixed_row_params": dict(MIXED_SAMPLING),
        "plain_tok_per_s": plain_tps,
        "mixed_tok_per_s": mixed_tps,
        "plain_tok_per_s_runs": runs["plain"],
        "mixed_tok_per_s_runs": runs["mixed"],
        "ratio": mixed_tps / plain_tps,
    }


def _decode_tok_per_s(eng: LLMEngine, batch, params: list[SamplingParams]) -> float:
    """Prefill the batch untimed, then decode it to the end: the median over its decode
    steps of tokens made / step time (a row a prefill chunk ahead ends a step early)."""
    seqs = [eng.add_request(GenerateRequest(p, s, a)) for (p, a), s in zip(batch, params)]
    live = {s.request_id for s in seqs}

    def step() -> int:
        made = 0
        for group, replies in eng.step().items():
            made += sum(len(r.token_ids) for r in replies)
            if group.finished:
                live.discard(group.request.request_id)
        return made

    for _ in range(10_000):  # prefill everything, wait for loads
        if all(s.output_ids for s in seqs):
            break
        step()
    rates = []
    for _ in range(1_000_000):
        if not live:
            break
        t0 = time.perf_counter()
        made = step()
        rates.append(made / (time.perf_counter() - t0))
    return statistics.median(rates)


# -- tensor parallelism: what one decode step sends ------------------------------------------------


def _tp_comm(assets, n_adapters: int, args: argparse.Namespace) -> dict:
    """Payload bytes rank 0 sends in one decode step of n sequences, by collective, with
    a base-only batch and with n distinct adapters; per decoder layer, the base model
    all-reduces [T, hidden] after o_proj and down_proj, and LoRA adds the [T, R] all-reduce
    of those two row-parallel layers' shrink (R = max_lora_rank, fp32)."""
    names = list(assets.adapters)[:n_adapters]
    residency = {"num_slots": n_adapters + 1, "max_loras_per_batch": n_adapters}
    cfg = EngineConfig(model=str(assets.model_dir), device="auto", adapters=residency,
                       max_num_seqs=n_adapters, kv_cache_bytes=_kv_bytes(args),
                       max_model_len=_max_model_len(args), tp_size=args.tp)  # fmt: skip
    eng = LLMEngine(cfg)
    try:
        for name in names:
            eng.load_adapter(name, assets.adapters[name])
            # into its slot now: every request then prefills in one step and the measured
            # step decodes all of them (loads landing step by step let the first requests
            # reach max_tokens before the last one decodes)
            eng.adapters.wait_ready(name)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 2000) for _ in range(args.prompt_len)] for _ in names]
        steps = {
            "base": _decode_step_bytes(eng, prompts, [None] * len(names)),
            "lora": _decode_step_bytes(eng, prompts, names),
        }
        layers, hidden = eng.spec.num_layers, eng.spec.hidden_size
    finally:
        eng.shutdown()
    per_layer = {k: (v.get("layer", 0) + v.get("lora", 0)) / layers for k, v in steps.items()}
    return {
        "tp_size": args.tp,
        "decode_tokens": len(names),
        "hidden_size": hidden,
        "max_lora_rank": cfg.max_lora_rank,
        "bytes_per_step_by_collective": steps,
        "bytes_per_layer_base": per_layer["base"],
        "bytes_per_layer_lora": per_layer["lora"],
        "lora_extra_bytes_per_layer": per_layer["lora"] - per_layer["base"],
    }


def _decode_step_bytes(eng: LLMEngine, prompts, adapters) -> dict[str, int]:
    """Bytes rank 0 sends, by collective, in one decode-only step of every sequence."""
    comm = eng.executor.group.rank.comm
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seqs = [eng.add_request(GenerateRequest(p, sampling, a)) for p, a in zip(prompts, adapters)]
    for _ in range(10_000):  # prefill everything, wait for loads
        if all(s.output_ids for s in seqs):
            break
        eng.step()
    before = dict(comm.bytes)
    eng.step()
    for s in seqs:
        eng.abort(s)
    return {tag: n - before.get(tag, 0) for tag, n in comm.bytes.items() if n > before.get(tag, 0)}


# -- printing and helpers -----------------------------------------------------------------------


def _print_table(results: dict[str, EngineRun]) -> None:
    cols = ("tok/s", "TTFT p50 base", "TTFT p50 lora", "E2E p95 base", "E2E p95 lora", "loads",
            "evictions", "load wait s", "mem rows")  # fmt: skip
    print(f"{'scenario':<24}" + "".join(f"{c:>15}" for c in cols))
    for name, r in results.items():
        s = r.summary()
        rows = f"{r.churn.memory_rows}/{r.churn.working_set_rows}" if r.churn else "all"
        row = [f"{r.tok_per_s:.1f}", _ms(s, "ttft_base_p50_s"), _ms(s, "ttft_adapter_p50_s"),
               _ms(s, "e2e_base_p95_s"), _ms(s, "e2e_adapter_p95_s"), str(r.adapter_loads),
               str(r.evictions), f"{r.load_wait_s:.3f}", rows]  # fmt: skip
        print(f"{name:<24}" + "".join(f"{c:>15}" for c in row))
    print("(mem rows: the run's adapter memory / the rows its adapters need together, "
          "in rank rows; all: every adapter fits)")  # fmt: skip


def _print_headline(r: dict) -> None:
    b = r["hf_peft_baseline"]
    print(f"\ntransformers+PEFT baseline: {b['tok_per_s']:.1f} tok/s over {b['requests']} requests")
    print(
        f"speedup_vs_hf_peft                       {r['speedup_vs_hf_peft']:.2f}x "
        f"(ceiling ~{r['speedup_ceiling_estimate']:.1f}x with LoRA free, "
        f"~{r['speedup_ceiling_with_lora_decode']:.1f}x with LoRA decode at its measured cost)"
    )
    c, s = r["churn"], r["scenarios"]
    print(
        f"load_stall_ratio_overlap_on_vs_off       {r['load_stall_ratio_overlap_on_vs_off']:.3f} "
        f"(ceiling 0; with a spare max-rank block for prefetch: "
        f"{r['load_stall_ratio_with_spare_slot']:.3f}; loads {c['load_delay_ms']:.1f} ms "
        f"each; distinct: {s['distinct']['adapter_loads']} loads, "
        f"{s['distinct']['evictions']} evictions)"
    )
    print(
        f"base_ttft_p50_ratio_churn_vs_base_only   "
        f"{r['base_ttft_p50_ratio_churn_vs_base_only']:.2f} (ideal 1.0)"
    )
    print(
        f"base_ttft_p50_ratio_unpinned_vs_base_only "
        f"{r['base_ttft_p50_ratio_unpinned_vs_base_only']:.2f} (ablation: base slot unpinned)"
    )
    step = r["decode_step_ratio_16_adapters_vs_base"]
    print(f"decode_step_ratio_16_adapters_vs_base    {step:.3f}"
          f" vs bytes ratio {r['decode_bytes_ratio_16_adapters_vs_base']:.3f} -> "
          f"decode_step_overhead_vs_bytes {r['decode_step_overhead_vs_bytes']:.3f} "
          "(ceiling 1.0)")  # fmt: skip
    m = r["mixed_sampling"]
    print(f"decode_tok_per_s_ratio_mixed_vs_plain_sampling {m['ratio']:.3f} "
          f"({m['mixed_tok_per_s']:.1f} vs {m['plain_tok_per_s']:.1f} decode tok/s, batch "
          f"{m['batch']}, greedy, {m['mixed_rows']} rows with penalties + logprobs=5, the "
          f"rest plain; ideal 1.0)")  # fmt: skip
    print("targets (benchmarks/targets.toml):")
    for line in harness.verdict_lines(r["targets"]):
        print(f"  {line}")


def _print_tp_comm(c: dict) -> None:
    t, r, h = c["decode_tokens"], c["max_lora_rank"], c["hidden_size"]
    base, lora, extra = (
        c["bytes_per_layer_base"], c["bytes_per_layer_lora"], c["lora_extra_bytes_per_layer"]
    )  # fmt: skip
    print(f"\ntensor parallelism, tp_size {c['tp_size']}: payload bytes rank 0 sends in one "
          f"decode step of {t} tokens")  # fmt: skip
    print(f"  per layer, base only:     {base:>10,.0f}  (o and down all-reduce [T, {h}])")
    print(f"  per layer, with adapters: {lora:>10,.0f}  (+{extra:,.0f}: [T, {r}] shrink of each)")
    for label, tags in c["bytes_per_step_by_collective"].items():
        print(f"  per step, {label:<5} " + ", ".join(f"{k} {v:,}" for k, v in tags.items()))


def _max_model_len(args: argparse.Namespace) -> int:
    """What a sequence of the bench reaches (prompt, output, slack): what _kv_bytes sizes."""
    return args.prompt_len + args.output_len + 32


def _kv_bytes(args: argparse.Namespace, spec: ModelSpec | DemoSpec | None = None) -> int:
    spec = spec or DemoSpec()
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    seqs = max(args.concurrency, min(16, args.adapters))  # a scenario's batch, a decode step's
    return int(per_token * _max_model_len(args) * seqs * 1.25)


def _zipf_weights(n: int, alpha: float) -> list[float]:
    return [1.0 / (k + 1) ** alpha for k in range(n)]


def _ms(summary: dict, key: str) -> str:
    return f"{ms(summary[key], 0)} ms" if key in summary else "-"


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items() if not callable(v)}


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
