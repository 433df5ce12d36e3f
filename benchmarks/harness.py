"""The one harness every benchmark runs on: sizes, load runs, targets, output, a local Ray.

Sizes      how much load a run gets: one dataclass, each bench naming its full and --quick sizes
RunResult  one load run against a server (`lorafleet bench http`'s run_load): its summary, TTFTs
targets    benchmarks/targets.toml, the one file of pass/fail targets: `check` reports each
           figure as met, NOT met or unknown; no bench asserts one
output     where a bench writes its JSON and plot, what a run records of itself (command,
           machine, date, commit), the cells of its tables
Ray        a local Ray for the demo cluster, and the demo application's Serve config
main       a bench's command line: `python -m benchmarks NAME ...` or `python -m benchmarks.NAME`

Only the standard library at module level: the GPU bench runs on a machine without Ray,
httpx or matplotlib, which the functions that need them import themselves. Percentiles
and millisecond cells are the load generator's (cluster/bench/stats.py). The targets are
read with tomllib: the benchmarks want Python 3.11 or newer (the package 3.10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import tomllib

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS_FILE = Path(__file__).resolve().parent / "targets.toml"


# -- sizes and load runs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How much load a bench's runs get. A bench reads the fields it needs (the rest keep
    their defaults and are written with them, so a JSON says everything a run was given)."""

    requests: int = 96  # measured per run (multi-turn: turns)
    warmup: int = 32  # sent first, same load, unmeasured
    concurrency: int = 16  # in flight (multi-turn: conversations)
    prompt_tokens: int = 128  # per request (shared-prefix: the message after the prefix)
    max_tokens: int = 32  # output tokens per request
    adapters: int = 16
    replicas: int = 2
    slots: int | None = None  # adapter slots per replica, the base's included (None: config's)
    kv_cache_bytes: int = 256 * 2**20  # per replica, and an in-process engine's
    settle_s: float = 1.5  # wait for the replicas' counters (published every 0.5 s)
    rates: tuple[float, ...] = ()  # suite: Poisson request rates swept
    prefix_tokens: int = 1000  # prefix: each adapter's system prompt
    turn_tokens: int = 64  # prefix: each multi-turn message
    turns: int = 4  # prefix: turns per conversation
    register_concurrency: int = 8  # many-adapters: registrations in flight
    cold_probes: int = 8  # many-adapters: adapters probed one at a time after the sweep

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


@dataclass
class RunResult:
    """One load run against a server: the bench's description of it (`run`), the load
    generator's summary of what the client saw, and every successful request's TTFT."""

    run: Any
    summary: dict
    ttfts_s: list[float] = field(default_factory=list)


async def measure_load(run: Any, options: Any) -> RunResult:
    """`options` (a cluster.bench.http.LoadOptions) sent by the load generator, as `run`."""
    from cluster.bench.http import run_load

    result = await run_load(options)
    ttfts = [r.ttft_s for r in result.records if r.ok and r.ttft_s is not None]
    return RunResult(run, result.summary(), ttfts)


def load_options(sizes: Sizes, url: str, label: str, **overrides: Any) -> Any:
    """The load generator's options (cluster.bench.http.LoadOptions) for one run of
    `sizes` against `url`; `overrides` set the scenario and what else differs."""
    from cluster.bench.http import LoadOptions

    return LoadOptions(**{
        "url": url, "concurrency": sizes.concurrency, "num_requests": sizes.requests,
        "warmup_requests": sizes.warmup, "prompt_tokens": sizes.prompt_tokens,
        "max_tokens": sizes.max_tokens, "stats_settle_s": sizes.settle_s, "label": label,
        **overrides,
    })  # fmt: skip


def load_run(run: Any, options: Any) -> RunResult:
    """measure_load from synchronous code."""
    return asyncio.run(measure_load(run, options))


# -- targets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A bound on one figure: at least `min`, at most `max`, or `near` within a relative
    `tolerance` (|value / near - 1| <= tolerance)."""

    figure: str
    min: float | None = None
    max: float | None = None
    near: float | None = None
    tolerance: float = 0.0
    what: str = ""

    def met(self, value: float | None) -> bool | None:
        """Whether `value` meets the target; None when it is unknown."""
        if value is None:
            return None
        if self.near is not None:
            return abs(value / self.near - 1) <= self.tolerance + 1e-12
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        if self.near is not None:
            return f"{self.near:g} within {self.tolerance:.0%}"
        bounds = [(">=", self.min), ("<=", self.max)]
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)


def targets(group: str, path: Path = TARGETS_FILE) -> dict[str, Target]:
    """The targets of one bench (a table of targets.toml), by the figure each bounds."""
    table = tomllib.loads(path.read_text()).get(group)
    if table is None:
        raise KeyError(f"{path}: no [{group}] targets")
    return {name: Target(name, **bound) for name, bound in table.items()}


def check(group: str, figures: Mapping[str, float | None]) -> dict[str, dict]:
    """{figure: {value, target, met}} for every target of `group`; a figure missing from
    `figures` is unknown (met None), never a failure of the bench."""
    out = {}
    for name, target in targets(group).items():
        value = figures.get(name)
        out[name] = {"value": value, "target": target.describe(), "met": target.met(value)}
    return out


def verdict(checked: Mapping, digits: int = 2) -> str:
    """A checked target in words: '0.30 (target <= 0.35: met)'."""
    return (
        f"{num(checked['value'], digits)} (target {checked['target']}: {met_word(checked['met'])})"
    )


def verdict_lines(checked: Mapping[str, Mapping]) -> list[str]:
    """One line per checked target of `check`: the figure's name and its verdict."""
    return [f"{name} {verdict(c, 3)}" for name, c in checked.items()]


# -- output -------------------------------------------------------------------------------------


def add_output_arguments(
    p: argparse.ArgumentParser, default_json: Path, default_plot: Path, plot_what: str
) -> None:
    """--quick, --json and --plot, as every bench that writes a JSON and a plot takes them."""
    p.add_argument("--quick", action="store_true",
                   help="Tiny loads: a smoke run; writes nothing unless --json or --plot say "
                        "where.")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help=f"Write every figure here (default {default_json}; with --quick, "
                        "none).")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None,
                   help=f"{plot_what} (default {default_plot}; with --quick, none). Needs "
                        "matplotlib (the bench extra).")  # fmt: skip


def output_paths(
    args: argparse.Namespace, default_json: Path, default_plot: Path | None = None
) -> tuple[Path | None, Path | None]:
    """Where a bench writes its JSON and plot: --json / --plot, else the defaults (nothing
    with --quick). A plot needs matplotlib (the bench extra): checked before the runs,
    not after them."""
    json_path = args.json or (None if args.quick else default_json)
    plot_path = getattr(args, "plot", None) or (None if args.quick else default_plot)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(
                f"{args.command}: the plot needs matplotlib: pip install -e '.[bench]'"
            ) from None
    return json_path, plot_path


def write_json(path: Path | None, doc: Mapping) -> None:
    """`doc` as indented JSON at `path` (its folder made), announced; nothing for None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def run_meta(args: argparse.Namespace) -> dict:
    """What a run records of itself: its command, the date, the machine, the commit."""
    return {
        "command": getattr(args, "command", None),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "git_commit": git_commit(),
    }


def machine() -> dict[str, object]:
    """Where a benchmark ran."""
    import torch  # every bench has it loaded by now

    return {
        "cpu": cpu_name(),
        "cpu_count": num_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def machine_line(m: Mapping[str, object]) -> str:
    """The machine in a sentence, for a table's caption."""
    return f"{m['cpu']}, {m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}"


def num_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The checkout's commit (a rerun after an engine change says which code it measured)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (other work on the machine shows here)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is unknown or b is 0."""
    return a / b if a is not None and b else None


def num(x: float | None, digits: int = 2, suffix: str = "") -> str:
    """A figure for a table cell; '-' when unknown."""
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def met_word(ok: bool | None) -> str:
    return "unknown" if ok is None else ("met" if ok else "NOT met")


# -- device timing --------------------------------------------------------------------------------


class Clock:
    """Seconds one call takes: wall time on a CPU, CUDA events around it on a GPU (no host
    sync inside the call, so launch gaps count where the device waits for the host)."""

    def __init__(self, device: Any) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Any) -> float:
        import time

        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def copy_bandwidth(device: Any, nbytes: int, reps: int = 5) -> float:
    """Bytes per second a device copy larger than the caches moves, read + write counted
    (the fastest of `reps`): the bandwidth a memory-bound step can reach."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    clock = Clock(torch.device(device))
    return 2 * src.nbytes / min(clock.time(lambda: dst.copy_(src)) for _ in range(reps))


# -- plots ----------------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def plot_ttft_cdfs(panels: Mapping[str, Mapping[str, Sequence[float]]], path: Path) -> None:
    """TTFT CDFs to a PNG: a panel per key of `panels` (its title), a line per label of
    each panel's {label: TTFTs in seconds}."""
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items()):
        for label, ttfts_s in lines.items():
            xs = np.sort(np.array(ttfts_s) * 1000)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
        ax.set(title=title, xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    save_plot(fig, path)


# -- a local Ray and the demo application --------------------------------------------------------


def start_ray(num_cpus: int) -> None:
    """A fresh local Ray of num_cpus CPUs, for the demo cluster a bench deploys."""
    import ray

    # metrics every second (not 10): a bench's cluster is short-lived
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace="serve", log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip


def stop_ray() -> None:
    """Serve and the Ray that start_ray started."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """start_ray for the block, stop_ray after it."""
    start_ray(num_cpus)
    try:
        yield
    finally:
        stop_ray()


# A bench's cluster stops when its runs are done (stop_ray; `prefix` between setups). A
# stopping replica sleeps graceful_shutdown_wait_loop_s (Serve's default: 2 s) before it
# first looks for requests still running, and nothing runs by then: serve.shutdown took ~7 s
# with the default, ~2 s with this. Requests in flight would still be waited for.
STOP_POLL_S = 0.1


def demo_serve_config(sizes: Sizes, port: int, settings: Sequence[str] = ()) -> dict:
    """configs/serve.yaml serving the random-weight demo model (whatever model the file
    serves) with sizes.adapters demo adapters on sizes.replicas replicas, slots and KV
    from `sizes`; `settings` are more `lorafleet up --set` overrides. Its replicas stop
    without Serve's 2 s waits (STOP_POLL_S)."""
    from cluster import serving

    everything = [
        "engine.model=demo",
        "store.adapters=demo",
        f"store.demo_adapters={sizes.adapters}",
        *([f"engine.adapters.num_slots={sizes.slots}"] if sizes.slots is not None else []),
        f"engine.kv_cache_bytes={sizes.kv_cache_bytes}",
        "routing.stats_period_s=0.5",
        *settings,
    ]
    base = serving.load_config(serving.DEFAULT_CONFIG)
    config = serving.apply_overrides(base, replicas=sizes.replicas, port=port, settings=everything)
    deployments = config["applications"][0].setdefault("deployments", [])
    listed = {d["name"] for d in deployments}
    deployments += [{"name": n} for n in ("AdapterStore", "Ingress") if n not in listed]
    for d in deployments:
        d.setdefault("graceful_shutdown_wait_loop_s", STOP_POLL_S)
    return config


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the command line -----------------------------------------------------------------------------


def subset_of(choices: Sequence[str]) -> Any:
    """An argparse type: a comma-separated subset of `choices`, as a tuple in their order."""

    def parse(text: str) -> tuple[str, ...]:
        names = {n.strip() for n in text.split(",") if n.strip()}
        if not names or names - set(choices):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated subset of {', '.join(choices)}"
            )
        return tuple(c for c in choices if c in names)

    return parse


def bench_name(module: ModuleType) -> str:
    """`benchmarks.many_adapters` -> `many-adapters` (what `python -m benchmarks` takes)."""
    name = module.__spec__.name if module.__spec__ else module.__name__
    return name.rsplit(".", 1)[-1].replace("_", "-")


def parser(module: ModuleType) -> argparse.ArgumentParser:
    """A bench module's command line: its docstring as the help, its add_arguments."""
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks {bench_name(module)}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(p)
    p.set_defaults(command=p.prog)  # main() records the whole command line
    return p


def main(module: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` for the bench `module` and run it; its exit status. The command as
    typed is args.command, which the run records."""
    argv = list(argv) if argv is not None else []
    args = parser(module).parse_args(argv)
    args.command = shlex.join(["python", "-m", "benchmarks", bench_name(module), *argv])
    return module.run(args) or 0
