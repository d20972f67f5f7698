"""The benchmarks' repeat helper: each figure of repeated runs is the median and the range."""

from __future__ import annotations

from benchmarks.common import SIZES, repeat, spread


def test_spread_prints_median_and_range() -> None:
    assert spread([4.61, 3.9, 4.15]) == "4.15 (3.90-4.61)"
    assert spread([0.66, 0.71, 0.69], "x", 2) == "0.69x (0.66x-0.71x)"
    assert spread([2_000.0, 1_500.0, 1_800.0]) == "1,800 (1,500-2,000)"


def test_spread_of_one_run_or_of_nothing() -> None:
    assert spread([2.5]) == "2.50"
    assert spread([float("nan"), 2.5]) == "2.50"  # a run that measured nothing is left out
    assert spread([]) == "-" and spread([float("nan")]) == "-"


def test_repeat_runs_each_size_that_many_times() -> None:
    assert repeat(3, lambda i: i * 10) == [0, 10, 20]
    assert repeat(0, lambda i: i) == [0]  # at least once
    assert SIZES["full"].repeats == 3 and SIZES["smoke"].repeats == 1
