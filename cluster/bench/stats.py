"""The load generator's figures: percentiles and millisecond cells (the benchmarks' too)."""

from __future__ import annotations

from collections.abc import Sequence

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
