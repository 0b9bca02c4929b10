"""The benchmarks' statistics on inputs whose answers are known by hand."""

from __future__ import annotations

import math

import pytest

from bench.stats import floor_percentile, mean, median, median_of, ms, nearest_rank, percentile

TEN = [float(v) for v in range(1, 11)]  # 1.0 .. 10.0


@pytest.mark.parametrize(
    ("q", "expected"), [(0.0, 1.0), (0.2, 2.0), (0.25, 3.0), (0.42, 5.0), (0.95, 10.0), (1.0, 10.0)]
)
def test_percentile_is_the_nearest_rank(q: float, expected: float) -> None:
    assert percentile(TEN, q) == expected
    assert nearest_rank(TEN, q) == expected


@pytest.mark.parametrize(("q", "expected"), [(0.1, 2.0), (0.5, 6.0), (0.9, 10.0)])
def test_an_odd_whole_rank_is_taken_one_higher(q: float, expected: float) -> None:
    # The convention the recorded figures were taken with: rank round(q * n + 0.5), ties to even.
    assert percentile(TEN, q) == expected


def test_percentile_sorts_its_input_and_nearest_rank_trusts_it() -> None:
    shuffled = [7.0, 3.0, 10.0, 1.0, 5.0]
    assert percentile(shuffled, 0.5) == 5.0
    assert percentile(shuffled, 1.0) == 10.0
    assert nearest_rank(shuffled, 1.0) == 5.0  # the last value, sorted or not


def test_percentile_of_a_hundred_values_matches_the_recorded_convention() -> None:
    values = [float(v) for v in range(100)]
    # round() breaks ties to even: rank round(50.5) = 50, round(99.5) = 100.
    assert percentile(values, 0.5) == 49.0
    assert percentile(values, 0.99) == 99.0


@pytest.mark.parametrize(("q", "expected"), [(0.0, 1.0), (0.5, 6.0), (0.95, 10.0), (0.99, 10.0), (1.0, 10.0)])
def test_floor_percentile_takes_the_value_at_index_floor_q_n(q: float, expected: float) -> None:
    assert floor_percentile(reversed(TEN), q) == expected


def test_nothing_measured_is_nan_not_an_error() -> None:
    for value in (percentile([], 0.5), floor_percentile([], 0.5), median([]), mean([])):
        assert math.isnan(value)


def test_median_skips_missing_values() -> None:
    assert median([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(median([math.nan, math.nan]))


def test_median_of_a_figure_over_runs() -> None:
    runs = [[1.0, 2.0, 30.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    assert median_of(runs, lambda run: percentile(run, 0.5)) == 5.0
    assert median_of(runs, max) == 9.0


def test_mean_and_milliseconds() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert ms(2_500_000) == 2.5
