"""`python -m benchmarks tenants`: fair share between tenants on one replica (issue 30).

One replica's engine, in-process: an `LLMEngine` on the demo model and its adapters,
stepped by this process's loop as the replica's engine thread steps it (no Ray, no HTTP:
what is measured is the engine's admission order, not the network). Two tenants:

  A  floods: a closed loop of `--flood` requests in flight (default 64, more than the
     batch's `--max-num-seqs` seats, so A always has requests waiting), on adapters
  B  sends one request every 1/`--rate` seconds (default 1/s), on other adapters

Runs (each on a fresh engine, primed with two requests per adapter, then `--warmup`
seconds of its load unmeasured):

  alone    B alone
  fcfs     A's flood + B, engine.scheduling=fcfs (arrival order)
  vtc      A's flood + B, engine.scheduling=vtc (weighted Virtual Token Counter)
  weights  A and B both flooding, weights 2:1, vtc (`--duration` s)

alone, fcfs and vtc take turns `--repeats` times (fcfs and vtc `--duration`/repeats
seconds each, alone half that), each pooling its runs, so that a busy neighbour on the
machine slows them alike. Request lengths vary (max_tokens uniform in [len/2, 3 len/2])
so that seats free at staggered steps.

It reports B's TTFT p50/p99 (from its arrival time to its first token), the median step,
total output tok/s, and per consecutive 10 s window each tenant's service (1 per uncached
prompt token + 2 per output token, VTC's measure, divided by the tenant's weight): the
largest difference between A's and B's, and for `weights` the service ratio A/B. Targets
(benchmarks/targets.toml [tenants]):

  vtc_ttft_p50_vs_alone   vtc: B's TTFT p50 under the flood over its TTFT p50 alone
  vtc_tok_s_vs_fcfs       vtc: total output tok/s over fcfs's
  weights_service_ratio   weights 2:1: service ratio A/B

    python -m benchmarks tenants                  # ~6 minutes on a 2-core CPU
    python -m benchmarks tenants --duration 10    # a shorter run (one 10 s window per run)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import num, ratio
from cluster.bench.stats import ms, percentile
from cluster.demo.assets import DemoSpec, cached_demo_assets
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.engine.fair_share import W_IN, W_OUT
from replica.engine.sequence import Sequence
from replica.wire import GenerateRequest, SamplingParams

DEFAULT_JSON = harness.RESULTS / "tenants.json"
DEFAULT_PLOT = harness.RESULTS / "tenants_ttft.png"
WINDOW_S = 10.0
# after the measured time, the flood goes on (unmeasured) until every measured request of B
# has its first token, so that slow TTFTs are counted rather than cut off; at most this long
DRAIN_CAP_S = 120.0


@dataclass
class Request:
    tenant: str
    arrival: float  # seconds since the run's start
    first: float | None = None


@dataclass
class Trace:
    """One run: B's requests, and every tenant's service as (time, tenant, amount)."""

    name: str
    duration_s: float
    requests: list[Request] = field(default_factory=list)
    service: list[tuple[float, str, float]] = field(default_factory=list)
    output_tokens: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)  # measured steps that drew tokens


def joined(traces: list[Trace]) -> Trace:
    """Runs of one kind as one trace, each after the other on the time axis."""
    out, offset = Trace(traces[0].name, 0.0), 0.0
    for t in traces:
        out.requests += [
            Request(r.tenant, r.arrival + offset, None if r.first is None else r.first + offset)
            for r in t.requests
        ]
        out.service += [(at + offset, tenant, x) for at, tenant, x in t.service]
        out.output_tokens += t.output_tokens
        out.step_s += t.step_s
        out.counters = t.counters
        offset += t.duration_s
    out.duration_s = offset
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=40.0,
                   help="Seconds measured per flood run (the alone and weights runs: half "
                        "and the same); 10 s windows.")  # fmt: skip
    p.add_argument("--warmup", type=float, default=10.0,
                   help="Seconds of unmeasured load before each run (the flood's first "
                        "batch, admitted at once, must have turned over).")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2,
                   help="fcfs and vtc alternate this many times, each for duration/repeats "
                        "(the machine's drift hits both); their figures are pooled.")  # fmt: skip
    p.add_argument("--flood", type=int, default=64, help="A's requests in flight.")
    p.add_argument("--rate", type=float, default=1.0,
                   help="B's requests per second: modest, well under half of what the "
                        "replica serves, or B is backlogged too and fair share splits the "
                        "replica evenly (its TTFT then grows with its own queue).")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=32, help="Seats of the running batch.")
    p.add_argument("--prompt-len", type=int, default=64, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=32,
                   help="Mean output tokens per request: each draws its max_tokens uniformly "
                        "from [len/2, 3 len/2], so running requests end at staggered "
                        "steps, as real ones do.")  # fmt: skip
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: steady step times on a CPU shared with other "
                        "work; more threads stall on a busy machine).")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="Where to write the JSON.")
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                   help="B's TTFT over time, alone, fcfs and vtc (matplotlib).")  # fmt: skip
    p.add_argument("--no-plot", action="store_true", help="Write no plot.")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    assets = cached_demo_assets(DemoSpec())
    adapters = list(assets.adapters)
    bench = Bench(args, str(assets.model_dir), assets.adapters)
    a_adapters, b_adapters = adapters[: len(adapters) // 2], adapters[len(adapters) // 2 :]
    print(
        f"bench tenants: one in-process engine (demo model, {len(adapters)} adapters, "
        f"{args.max_num_seqs} seats); A floods with {args.flood} in flight on "
        f"{','.join(a_adapters)}; B sends {args.rate:g}/s on {','.join(b_adapters)}; "
        f"{args.prompt_len} prompt tokens and ~{args.output_len} output tokens per request; "
        f"{args.threads} torch thread(s)",
        flush=True,
    )
    part = args.duration / args.repeats
    rotation: dict[str, list[Trace]] = {"alone": [], "fcfs": [], "vtc": []}
    for _ in range(args.repeats):
        rotation["alone"].append(bench.run("alone", "fcfs", part / 2, 0, None, b_adapters))
        for scheduling in ("fcfs", "vtc"):
            rotation[scheduling].append(bench.run(scheduling, scheduling, part, args.flood,
                                                  a_adapters, b_adapters))  # fmt: skip
    weights = bench.run("weights", "vtc", args.duration, args.flood, a_adapters, b_adapters,
                        b_flood=args.flood, weights={"A": 2.0, "B": 1.0})  # fmt: skip
    traces = {**{k: joined(v) for k, v in rotation.items()}, "weights": weights}
    figures = {name: summarize(t, {"A": 2.0, "B": 1.0} if name == "weights" else {})
               for name, t in traces.items()}  # fmt: skip
    verdict = compare(figures)
    meta = {
        **harness.run_meta(args),
        "how": "one in-process LLMEngine (the replica's engine, stepped by the bench's "
        "loop; no Ray, no HTTP)",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "service": f"per tenant: {W_IN:g} per uncached prompt token + {W_OUT:g} per output "
        "token, divided by its weight, in 10 s windows",
    }  # fmt: skip
    print(report(figures, verdict))
    points = {n: _ttft_points(traces[n]) for n in ("alone", "fcfs", "vtc")}
    body = {**meta, "comparison": verdict, "runs": figures, "b_ttft_over_time_s": points}
    harness.write_json(args.json, body)
    if not args.no_plot:
        plot_ttft_over_time(traces, args.plot)
        print(f"wrote {args.plot}")
    return 0


class Bench:
    def __init__(self, args: argparse.Namespace, model: str, adapters: dict[str, Path]) -> None:
        self.args, self.model, self.adapters = args, model, adapters
        self.rng = random.Random(args.seed)

    def engine(self, scheduling: str) -> LLMEngine:
        a = self.args
        eng = LLMEngine(EngineConfig(model=self.model, device="auto", scheduling=scheduling,
                                     max_num_seqs=a.max_num_seqs))  # fmt: skip
        for name, path in self.adapters.items():
            eng.load_adapter(name, path)
        return eng

    def prompt(self, vocab: int) -> list[int]:
        return [self.rng.randrange(3, vocab) for _ in range(self.args.prompt_len)]

    def sampling(self) -> SamplingParams:
        n = self.args.output_len
        max_tokens = self.rng.randint(max(1, n // 2), max(1, n + n // 2))
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def prime(self, eng: LLMEngine, adapters: list[str]) -> None:
        """Two requests per adapter run to completion, unmeasured and without a tenant
        (under VTC they count as a tenant of their own that then goes idle)."""
        for adapter in adapters * 2:
            eng.add_request(
                GenerateRequest(self.prompt(eng.spec.vocab_size), self.sampling(), adapter)
            )
        while eng.has_work():
            eng.step()

    def run(
        self,
        name: str,
        scheduling: str,
        duration_s: float,
        flood: int,
        a_adapters: list[str] | None = None,
        b_adapters: list[str] | None = None,
        b_flood: int = 0,
        weights: dict[str, float] | None = None,
    ) -> Trace:
        """A fresh engine, `warmup` seconds of the same load unmeasured, then `duration_s`
        measured. A (and B when b_flood) keep that many requests in flight; otherwise B
        arrives every 1/rate seconds, and the run goes on until each of B's requests has
        its first token (service and tok/s count the measured time only)."""
        eng = self.engine(scheduling)
        weights = weights or {"A": 1.0, "B": 1.0}
        # first steps pay one-time costs (adapter loads, lazy inits: seconds on a CPU)
        self.prime(eng, [*(a_adapters or []), *(b_adapters or [])])
        loops = {"A": (flood, a_adapters or []), "B": (b_flood, b_adapters or [])}
        trace = Trace(name, duration_s)
        live: dict[str, tuple[Request | None, str, Sequence]] = {}  # id -> what it is
        in_flight = dict.fromkeys(loops, 0)
        picks = dict.fromkeys(loops, 0)
        t0 = time.perf_counter() + self.args.warmup  # measuring starts here
        next_b = time.perf_counter()
        end = t0 + duration_s

        def submit(tenant: str, arrival: float) -> None:
            adapters = loops[tenant][1]
            adapter = adapters[picks[tenant] % len(adapters)]
            picks[tenant] += 1
            prompt = self.prompt(eng.spec.vocab_size)
            request = GenerateRequest(prompt, self.sampling(), adapter, tenant=tenant,
                                      tenant_weight=weights[tenant])  # fmt: skip
            seq = eng.add_request(request)
            measured = arrival >= t0
            req = Request(tenant, arrival - t0) if measured else None
            if req is not None and tenant == "B" and not b_flood:  # B's TTFTs at its rate
                trace.requests.append(req)
            live[seq.request_id] = (req, tenant, seq)
            in_flight[tenant] += 1

        while True:
            now = time.perf_counter()
            while not b_flood and self.args.rate > 0 and next_b <= min(now, end):
                submit("B", next_b)  # on B's clock, however long the last step took
                next_b += 1.0 / self.args.rate
            if now >= end and (all(r.first is not None for r in trace.requests)
                               or now >= end + DRAIN_CAP_S):  # fmt: skip
                break
            for tenant, (n, _) in loops.items():
                while n and in_flight[tenant] < n:
                    submit(tenant, now)
            started = time.perf_counter()
            outputs = eng.step()
            now = time.perf_counter()
            measuring = t0 <= started and now < end
            if measuring and outputs:
                trace.step_s.append(now - started)
            for group, replies in outputs.items():
                req, tenant, seq = live[group.request.request_id]
                drew = any(r.token_ids for r in replies)  # n = 1: one reply, one token
                if measuring and drew:
                    amount = W_OUT
                    if len(seq.output_ids) == 1:  # its first token: the prompt was served
                        amount += W_IN * (len(seq.prompt_ids) - (seq.num_cached_tokens or 0))
                    trace.service.append((now - t0, tenant, amount / weights[tenant]))
                    trace.output_tokens += 1
                if req is not None and req.first is None:
                    req.first = now - t0
                if group.finished:
                    del live[group.request.request_id]
                    in_flight[tenant] -= 1
        trace.counters = {str(k): v for k, v in eng.residency()["tenant_counters"].items()}
        eng.shutdown()
        print(f"  {name}: {_line(summarize(trace, {}))}", flush=True)
        return trace


# -- figures ------------------------------------------------------------------------------------


def windows(trace: Trace, width_s: float = WINDOW_S) -> list[dict[str, float]]:
    """Each tenant's service in consecutive windows of `width_s` over the measured run
    (a last window shorter than half a width is dropped)."""
    count = max(1, round(trace.duration_s / width_s))
    out = [{"A": 0.0, "B": 0.0} for _ in range(count)]
    for t, tenant, amount in trace.service:
        i = min(int(t // width_s), count - 1)
        out[i][tenant] = out[i].get(tenant, 0.0) + amount
    return out


def summarize(trace: Trace, weights: dict[str, float]) -> dict:
    """B's TTFT percentiles, output tok/s, and the service per window (already divided by
    the weights in the trace): the largest |A - B| and the ratio A/B over the run."""
    ttfts = [r.first - r.arrival for r in trace.requests if r.first is not None]
    ws = windows(trace)
    total = {t: sum(w[t] for w in ws) for t in ("A", "B")}
    unweighted = {t: total[t] * weights.get(t, 1.0) for t in total}
    both = all(total.values())  # the alone run has no A
    return {
        "b_requests": len(trace.requests),
        "b_ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "b_ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "b_ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "output_tok_per_s": trace.output_tokens / trace.duration_s,
        "step_p50_s": percentile(trace.step_s, 50) if trace.step_s else None,
        # B's TTFT p50 in steps of its own run: what scheduling decides, the step's cost
        # (which grows with the batch on a CPU) set apart
        "b_ttft_p50_steps": ratio(
            percentile(ttfts, 50) if ttfts else None,
            percentile(trace.step_s, 50) if trace.step_s else None,
        ),
        "service_windows": ws,
        "max_window_service_diff": max(abs(w["A"] - w["B"]) for w in ws) if both else None,
        "service_ratio_a_b": unweighted["A"] / unweighted["B"] if both else None,
        "counters": trace.counters,
    }


def compare(figures: dict[str, dict]) -> dict:
    """The ratios of the runs, each target checked (met None where unknown)."""
    alone, fcfs, vtc = figures["alone"], figures["fcfs"], figures["vtc"]
    ratios = {
        "vtc_ttft_p50_vs_alone": ratio(vtc["b_ttft_p50_s"], alone["b_ttft_p50_s"]),
        "fcfs_ttft_p50_vs_alone": ratio(fcfs["b_ttft_p50_s"], alone["b_ttft_p50_s"]),
        "vtc_tok_s_vs_fcfs": ratio(vtc["output_tok_per_s"], fcfs["output_tok_per_s"]),
        "weights_service_ratio": figures["weights"]["service_ratio_a_b"],
    }
    return {**ratios, "targets": harness.check("tenants", ratios)}


def report(figures: dict[str, dict], verdict: dict) -> str:
    lines = ["", "| run | B requests | B TTFT p50 / p99 ms | step p50 ms | out tok/s | "
             "max window service diff A-B | service A/B |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, f in figures.items():
        lines.append(
            f"| {name} | {f['b_requests'] or '-'} | {ms(f['b_ttft_p50_s'], 0)} / "
            f"{ms(f['b_ttft_p99_s'], 0)} | {ms(f['step_p50_s'], 0)} | "
            f"{f['output_tok_per_s']:.0f} | {num(f['max_window_service_diff'], 0)} | "
            f"{num(f['service_ratio_a_b'])} |"
        )
    t = verdict["targets"]
    lines += [
        "",
        f"- vtc: B's TTFT p50 under the flood / alone = "
        f"{harness.verdict(t['vtc_ttft_p50_vs_alone'])}; fcfs: "
        f"{num(verdict['fcfs_ttft_p50_vs_alone'])}. In steps of each run's median step: "
        + ", ".join(
            f"{n} {num(figures[n]['b_ttft_p50_steps'], 1)}" for n in ("alone", "fcfs", "vtc")
        ),
        f"- vtc total output tok/s / fcfs = {harness.verdict(t['vtc_tok_s_vs_fcfs'])}",
        f"- weights 2:1, both backlogged: service ratio A/B = "
        f"{harness.verdict(t['weights_service_ratio'])}",
    ]
    return "\n".join(lines)


def plot_ttft_over_time(traces: dict[str, Trace], path: Path) -> None:
    """B's TTFT against its arrival time, a line per run (alone, fcfs, vtc)."""
    fig, ax = harness.pyplot().subplots(figsize=(8, 4))
    for name in ("fcfs", "vtc", "alone"):
        points = _ttft_points(traces[name])
        ax.plot([p[0] for p in points], [p[1] * 1000 for p in points], marker=".", label=name)
    ax.set(xlabel="B's arrival (s into the run)", ylabel="B's TTFT (ms)", yscale="log",
           title="Tenant B's TTFT while tenant A floods (one replica)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    harness.save_plot(fig, path)


def _ttft_points(trace: Trace) -> list[tuple[float, float]]:
    return [(r.arrival, r.first - r.arrival) for r in trace.requests if r.first is not None]


def _line(f: dict) -> str:
    return (f"B TTFT p50 {ms(f['b_ttft_p50_s'], 0)} ms, p99 {ms(f['b_ttft_p99_s'], 0)} ms, "
            f"{f['output_tok_per_s']:.0f} out tok/s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(harness.main(sys.modules[__name__], sys.argv[1:]))
