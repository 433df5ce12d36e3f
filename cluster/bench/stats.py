"""What every benchmark reports the same way: percentiles, milliseconds, the machine."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

PERCENTILES = (50, 95, 99)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile of a non-empty sample (linear interpolation, as numpy's)."""
    return float(np.percentile(xs, q))


def percentiles(
    xs: Sequence[float], name: str, qs: Sequence[int] = PERCENTILES
) -> dict[str, float | None]:
    """{name}_p{q}_s for each q; None when there is no sample."""
    values = np.percentile(xs, qs).tolist() if len(xs) else [None] * len(qs)
    return {f"{name}_p{q}_s": v for q, v in zip(qs, values)}


def ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds for a table cell; '-' when missing."""
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


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


def machine() -> dict[str, object]:
    """Where a benchmark ran, for its JSON."""
    import torch  # the engine and kernel benches have it loaded anyway

    return {
        "cpu": cpu_name(),
        "cpu_count": num_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d"),
    }


def output_paths(
    args: argparse.Namespace, default_json: Path, default_plot: Path, command: str
) -> tuple[Path | None, Path | None]:
    """Where a bench writes its JSON and plot: --json / --plot, else the defaults (nothing
    with --quick). A plot needs matplotlib (the bench extra): checked before the runs,
    not after them."""
    json_path = args.json or (None if args.quick else default_json)
    plot_path = args.plot or (None if args.quick else default_plot)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(
                f"lorafleet bench {command}: the plot needs matplotlib: pip install -e '.[bench]'"
            ) from None
    return json_path, plot_path
