"""Gated DeltaNet prefill and decode on CPU: kernels' torch path against transformers.

    python -m benchmarks.gated_delta [--tokens 4096] [--rounds 5] [--threads N]

The layer core of a Qwen3.5 linear-attention layer (the causal conv1d + SiLU over the
fused q/k/v projection, then the gated delta rule with L2-normalised q and k, returning
the final state) at Qwen3.5's head shapes (transformers' Qwen3_5TextConfig defaults),
once through transformers' own torch implementation (causal_conv1d_fn then
torch_chunk_gated_delta_rule, as Qwen3_5GatedDeltaNet.forward calls them for a prompt)
and once through kernels.causal_conv1d + kernels.gated_delta_rule (the torch backend,
one sequence from zeros, states written to a pool). Decode: a batch of sequences one
token each, from their states (transformers: causal_conv1d_update then
torch_recurrent_gated_delta_rule on the batch).

Rounds alternate which side runs first; each run is timed by the wall clock and by the
process's CPU time. On a CPU shared with other work the wall clock of a 2-thread op
suffers most (a parallel region waits for its slowest thread), so both are reported,
with every run's figure, not only the best. The projections around the core (in_proj_*,
the gated RMSNorm, out_proj) are the same matmuls on both sides and are not timed.
Writes benchmarks/results/gated_delta.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

import kernels

RESULTS = Path(__file__).resolve().parent / "results" / "gated_delta.json"


def shapes() -> dict[str, int]:
    """Qwen3.5's linear-attention shapes, from transformers' config defaults."""
    c = Qwen3_5TextConfig()
    return {
        "key_heads": c.linear_num_key_heads,
        "value_heads": c.linear_num_value_heads,
        "key_head_dim": c.linear_key_head_dim,
        "value_head_dim": c.linear_value_head_dim,
        "conv_kernel": c.linear_conv_kernel_dim,
    }


class Layer:
    """One layer's conv weight and gate parameters, and a prompt's (or a decode step's)
    inputs to the layer core: mixed_qkv [T, conv_dim] and the gates g, beta [T, HV]."""

    def __init__(self, s: dict[str, int], tokens: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv = s["key_heads"], s["value_heads"]
        self.dk, self.dv, self.kernel = s["key_head_dim"], s["value_head_dim"], s["conv_kernel"]
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.weight = torch.randn(self.conv_dim, self.kernel, generator=gen) / self.kernel
        self.mixed_qkv = torch.randn(tokens, self.conv_dim, generator=gen)
        a_log = torch.empty(self.hv).uniform_(0.01, 16, generator=gen).log()  # as the layer
        dt_bias = torch.ones(self.hv)
        a = torch.randn(tokens, self.hv, generator=gen)
        self.g = -a_log.exp() * F.softplus(a + dt_bias)
        self.beta = torch.randn(tokens, self.hv, generator=gen).sigmoid()

    def split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., T, conv_dim] -> q, k [..., T, HK, dk] and v [..., T, HV, dv] (views)."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.unflatten(-1, (self.hk, self.dk)),
            k.unflatten(-1, (self.hk, self.dk)),
            v.unflatten(-1, (self.hv, self.dv)),
        )


def transformers_prefill(layer: Layer) -> torch.Tensor:
    mixed = hf.causal_conv1d_fn(layer.mixed_qkv.T[None], layer.weight, None, activation="silu")
    q, k, v = layer.split(mixed.transpose(1, 2))
    out, _state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=layer.g[None], beta=layer.beta[None], initial_state=None,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0]


def lorafleet_prefill(layer: Layer, conv_pool: torch.Tensor, pool: torch.Tensor):
    batch = kernels.make_state_batch([layer.mixed_qkv.shape[0]], [0], [False])
    mixed = kernels.causal_conv1d(layer.mixed_qkv, layer.weight, None, conv_pool, batch)
    q, k, v = layer.split(mixed)
    return kernels.gated_delta_rule(q, k, v, layer.g, layer.beta, pool, batch)


def transformers_decode(layer: Layer, conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    mixed = hf.causal_conv1d_update(layer.mixed_qkv[:, :, None], conv, layer.weight, None, "silu")
    q, k, v = layer.split(mixed.transpose(1, 2))  # [B, 1, heads, dim]
    out, _state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=layer.g[:, None], beta=layer.beta[:, None], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[:, 0]


def lorafleet_decode(layer: Layer, batch, conv_pool: torch.Tensor, pool: torch.Tensor):
    mixed = kernels.causal_conv1d(layer.mixed_qkv, layer.weight, None, conv_pool, batch)
    q, k, v = layer.split(mixed)
    return kernels.gated_delta_rule(q, k, v, layer.g, layer.beta, pool, batch)


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def race(sides: dict[str, callable], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Every side once per round, the order alternating, after one warm-up each."""
    for fn in sides.values():
        fn()
    runs = {name: {"wall_s": [], "cpu_s": []} for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu, _ = timed(sides[name])
            runs[name]["wall_s"].append(wall)
            runs[name]["cpu_s"].append(cpu)
    return runs


def summary(runs: dict[str, dict[str, list[float]]], tokens: int) -> dict:
    """tok/s per side (median, best, worst wall; median CPU time) and the speedup."""
    out = {}
    for name, r in runs.items():
        wall, cpu = r["wall_s"], r["cpu_s"]
        out[name] = {
            "tok_s_median": tokens / statistics.median(wall),
            "tok_s_best": tokens / min(wall),
            "tok_s_worst": tokens / max(wall),
            "cpu_tok_s_median": tokens / statistics.median(cpu),
            **r,
        }
    ours, theirs = out["lorafleet"], out["transformers"]
    out["speedup_median"] = ours["tok_s_median"] / theirs["tok_s_median"]
    out["speedup_cpu_median"] = ours["cpu_tok_s_median"] / theirs["cpu_tok_s_median"]
    out["speedup_per_round"] = [t / o for t, o in zip(theirs["wall_s"], ours["wall_s"])]
    return out


def measure(args: argparse.Namespace, s: dict[str, int]) -> dict:
    """Prefill and decode, both sides, at the current torch thread count."""
    layer = Layer(s, args.tokens)
    conv_pool = torch.zeros(1, layer.conv_dim, layer.kernel - 1)
    pool = torch.zeros(1, layer.hv, layer.dk, layer.dv)
    diff = (transformers_prefill(layer) - lorafleet_prefill(layer, conv_pool, pool)).abs()
    prefill = race(
        {
            "transformers": lambda: transformers_prefill(layer),
            "lorafleet": lambda: lorafleet_prefill(layer, conv_pool, pool),
        },
        args.rounds,
    )

    n = args.decode_batch
    step = Layer(s, n, seed=1)
    states = torch.randn(n, layer.hv, layer.dk, layer.dv) * 0.1
    convs = torch.randn(n, layer.conv_dim, layer.kernel - 1)
    batch = kernels.make_state_batch([1] * n, list(range(n)), [True] * n)
    decode_diff = (
        transformers_decode(step, convs.clone(), states.clone())
        - lorafleet_decode(step, batch, convs.clone(), states.clone())
    ).abs()
    # each side steps its own copy of the states over and over (the work does not
    # depend on their values)
    hf_state, hf_conv, our_pool, our_conv = states.clone(), convs.clone(), states, convs
    decode = race(
        {
            "transformers": lambda: transformers_decode(step, hf_conv, hf_state),
            "lorafleet": lambda: lorafleet_decode(step, batch, our_conv, our_pool),
        },
        args.rounds * 4,
    )
    return {
        "prefill": {"tokens": args.tokens, "max_abs_diff": diff.max().item(),
                    **summary(prefill, args.tokens)},
        "decode": {"sequences": n, "max_abs_diff": decode_diff.max().item(),
                   **summary(decode, n)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--rounds", type=int, default=5, help="prefill rounds (decode: 4x)")
    parser.add_argument("--decode-batch", type=int, default=32, help="sequences per decode")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, each measured")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()  # its "falling back to torch" notices
    s = shapes()
    result = {
        "what": "Gated DeltaNet layer core (conv1d+SiLU, gated delta rule) on CPU, fp32: "
        "kernels' torch path vs transformers' torch implementation",
        "command": f"python -m benchmarks.gated_delta --tokens {args.tokens} --rounds "
        f"{args.rounds} --decode-batch {args.decode_batch} --threads {args.threads}",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "shapes": s,
        "threads": {},
    }
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        r = result["threads"][str(threads)] = measure(args, s)
        for part in ("prefill", "decode"):
            p = r[part]
            rounds = p["speedup_per_round"]
            print(
                f"{threads} thread(s), {part}: transformers "
                f"{p['transformers']['tok_s_median']:.0f} tok/s, lorafleet "
                f"{p['lorafleet']['tok_s_median']:.0f} tok/s (median wall): "
                f"{p['speedup_median']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f}x; "
                f"CPU time {p['speedup_cpu_median']:.2f}x); max |diff| {p['max_abs_diff']:.1e}"
            )
    result["machine"]["loadavg_after"] = os.getloadavg()
    print(f"load average {result['machine']['loadavg_before']} -> {os.getloadavg()}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
