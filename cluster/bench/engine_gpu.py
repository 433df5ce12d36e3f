"""`lorafleet bench engine` on CUDA: what one decode step costs the host and the device.

- The demo model, 32 sequences over 16 adapters: host time to issue a decode step (CUDA
  graph replay vs eager launches), device time per step, decode tok/s, and the step with
  16 adapters against a base-only step, both as graph replays.
- A 1B-parameter Llama shape (TinyLlama's layers: hidden 2048, 22 layers, 32 heads, 4 KV
  heads, MLP 5632; a 2048-word vocabulary), random weights built here: its base-only
  decode step against the time to read its weights once at the bandwidth a large device
  copy measures (batch-32 decode is bound by reading the weights).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.demo.assets import DemoAssets, DemoSpec, cached_demo_assets
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.engine.planner import plan_batch
from replica.executor.batch import BatchPlan
from replica.wire import GenerateRequest, SamplingParams

BATCH = 32
ADAPTERS = 16
ONE_B = DemoSpec(
    hidden_size=2048,
    num_layers=22,
    num_heads=32,
    num_kv_heads=4,
    intermediate_size=5632,
    num_adapters=0,
)


def gpu_section(assets: DemoAssets, args: argparse.Namespace) -> dict:
    """Every figure of the GPU section, keyed as docs/performance.md quotes them."""
    names = list(assets.adapters)[:ADAPTERS]
    out: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "decode_batch": BATCH,
        "decode_adapters": len(names),
    }
    adapters = [names[i % len(names)] for i in range(BATCH)]
    for mode, graphs in (("graph", True), ("eager", False)):
        step = _decode_step(assets, names, adapters, graphs, args)
        out[f"host_us_per_decode_step_{mode}"] = step["host_s"] * 1e6
        out[f"device_us_per_decode_step_{mode}"] = step["device_s"] * 1e6
        out[f"decode_tok_per_s_{mode}"] = BATCH / step["wall_s"]
    base = _decode_step(assets, [], [None] * BATCH, True, args)
    out["device_us_per_decode_step_base_graph"] = base["device_s"] * 1e6
    out["decode_step_lora_over_base_graph"] = out["device_us_per_decode_step_graph"] / (
        base["device_s"] * 1e6
    )
    if not args.quick:  # builds and loads a 2 GB model
        out.update(_one_b(args))
    return out


def print_gpu_section(r: dict) -> None:
    print(
        f"GPU ({r['gpu']}), demo model, batch {r['decode_batch']} over "
        f"{r['decode_adapters']} adapters:\n"
        f"  host time to issue a decode step: graph {r['host_us_per_decode_step_graph']:.0f} us, "
        f"eager {r['host_us_per_decode_step_eager']:.0f} us\n"
        f"  device time per step: graph {r['device_us_per_decode_step_graph']:.0f} us "
        f"({r['decode_tok_per_s_graph']:.0f} tok/s), eager "
        f"{r['device_us_per_decode_step_eager']:.0f} us ({r['decode_tok_per_s_eager']:.0f} tok/s)\n"
        f"  16 adapters vs base only (graphs): {r['decode_step_lora_over_base_graph']:.2f}x"
    )
    if "decode_step_1b_us" in r:
        print(
            f"1B Llama shape, batch {r['decode_batch']}: step {r['decode_step_1b_us']:.0f} us "
            f"vs {r['hbm_limit_1b_us']:.0f} us to read {r['weight_bytes_1b'] / 1e9:.2f} GB at "
            f"{r['hbm_gbps']:.0f} GB/s: {r['decode_step_over_hbm_limit_1b']:.2f}x"
        )


def _decode_step(
    assets: DemoAssets,
    names: list[str],
    adapters: list[str | None],
    graphs: bool,
    args: argparse.Namespace,
    reps: int = 50,
) -> dict[str, float]:
    """One decode step of BATCH sequences, medians: host time to issue it, device time,
    wall time with sampling and the one device read; and the base weights' bytes."""
    eng = LLMEngine(
        EngineConfig(
            model=str(assets.model_dir),
            device="cuda",
            num_slots=max(2, len(names) + 1),
            max_loras_per_batch=max(1, len(names)),
            max_num_seqs=BATCH,
            kv_cache_bytes=1 << 30,
            cuda_graphs=graphs,
        )
    )
    try:
        for name in names:
            eng.load_adapter(name, assets.adapters[name])
        plan = _decoding_plan(eng, adapters, args.prompt_len)
        lora = eng.executor.lora
        host, device = [], []
        for i in range(reps + 5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            eng.executor.execute(plan, lora.table)
            issued = time.perf_counter() - t0
            end.record()
            end.synchronize()
            if i >= 5:  # warm
                host.append(issued)
                device.append(start.elapsed_time(end) / 1e3)
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            logits = eng.executor.execute(plan, lora.table)
            logits.argmax(-1).tolist()  # sync point, as in a step
            walls.append(time.perf_counter() - t0)
        return {
            "host_s": statistics.median(host),
            "device_s": statistics.median(device),
            "wall_s": statistics.median(walls),
            "weight_bytes": _weight_bytes(eng),
        }
    finally:
        eng.shutdown()


def _weight_bytes(eng: LLMEngine) -> int:
    """Bytes a decode step reads of the base weights (the embedding is read by row)."""
    weights = eng.executor.model.step_weights()
    return sum(w.numel() * w.element_size() for w in weights)


def _decoding_plan(eng: LLMEngine, adapters: list[str | None], prompt_len: int) -> BatchPlan:
    """Step the engine until every sequence decodes; the next step's plan (not run)."""
    sampling = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    vocab = eng.spec.vocab_size
    seqs = [
        eng.add_request(
            GenerateRequest([(7 * i + j) % (vocab - 3) + 3 for j in range(prompt_len)], sampling, a)
        )
        for i, a in enumerate(adapters)
    ]
    for _ in range(10_000):
        if all(s.output_ids for s in seqs):
            break
        eng.step()
    plan, _ = plan_batch(eng.scheduler.schedule().ordered(), eng.config.block_size)
    if plan.prefill_starts or len(plan.decode_context_lens) != len(adapters):
        raise RuntimeError("the bench's decode step is not decode-only")
    return plan


def _one_b(args: argparse.Namespace) -> dict:
    assets = cached_demo_assets(ONE_B)
    bandwidth = _copy_bandwidth()
    step = _decode_step(assets, [], [None] * BATCH, True, args)
    limit = step["weight_bytes"] / bandwidth
    return {
        "weight_bytes_1b": step["weight_bytes"],
        "hbm_gbps": bandwidth / 1e9,
        "decode_step_1b_us": step["device_s"] * 1e6,
        "hbm_limit_1b_us": limit * 1e6,
        "decode_step_over_hbm_limit_1b": step["device_s"] / limit,
    }


def _copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes per second moved by a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)
