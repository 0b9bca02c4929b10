"""Statistics of the benchmarks: percentiles, medians and means of samples.

A missing value is `nan` (a sample with no measurement, a process gone):
every function here answers `nan` for an empty input instead of raising, and
medians skip `nan`s, so that one failed run does not hide the others.

Two percentile conventions are in use, each kept for the figures already
recorded with it in docs/benchmarks.md: `percentile` (nearest rank) for the
services' benchmarks, `floor_percentile` for the memory's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..1; nan if empty).

    The rank is round(q * n + 0.5) (Python rounds ties to even), within 1..n:
    the usual ceil(q * n), but one rank higher when q * n is an odd whole
    number (the p50 of 10 values is the 6th). Kept as it is because the
    figures in docs/benchmarks.md were taken with it.
    """
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile of the values, in any order (q in 0..1; nan if empty)."""
    return nearest_rank(sorted(values), q)


def floor_percentile(values: Iterable[float], q: float) -> float:
    """The value at index floor(q * n) of the sorted values (the last one for q = 1; nan if empty)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def median(values: Iterable[float]) -> float:
    """The median of the values that are not nan (nan if none is)."""
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else float("nan")


def median_of(samples: Iterable[T], get: Callable[[T], float]) -> float:
    """The median of one figure over samples (runs), such as each run's p50."""
    return median(get(s) for s in samples)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean (nan if empty)."""
    return sum(values) / len(values) if values else float("nan")


def ms(ns: int) -> float:
    """Nanoseconds as milliseconds."""
    return ns / 1e6
