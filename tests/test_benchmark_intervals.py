"""The benchmarks' 95 % intervals: Student t quantiles from a table, mean and paired-difference intervals."""

from __future__ import annotations

import math

import pytest

from benchmarks.intervals import Interval, mean_interval, paired_difference, t_975


@pytest.mark.parametrize(
    ("df", "quantile"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (10, 2.228), (29, 2.045), (30, 2.042)],
)
def test_t_quantiles_match_the_printed_table(df: int, quantile: float) -> None:
    assert t_975(df) == quantile


@pytest.mark.parametrize(("df", "quantile"), [(31, 2.040), (40, 2.021), (60, 2.000), (120, 1.980)])
def test_beyond_the_table_the_corrected_normal_quantile_is_within_a_thousandth(
    df: int, quantile: float
) -> None:
    assert t_975(df) == pytest.approx(quantile, abs=0.001)


def test_the_quantile_shrinks_toward_the_normal_one_as_the_degrees_of_freedom_grow() -> None:
    quantiles = [t_975(df) for df in range(1, 200)]
    assert quantiles == sorted(quantiles, reverse=True)
    assert 1.96 < quantiles[-1] < 1.973  # t(0.975, 199) = 1.972


def test_zero_degrees_of_freedom_have_no_quantile() -> None:
    with pytest.raises(ValueError, match="at least 1 degree of freedom"):
        t_975(0)


def test_a_mean_interval_over_three_seeds_is_the_mean_plus_or_minus_t_times_the_standard_error() -> None:
    interval = mean_interval([0.5, 0.75, 1.0])
    half = 4.303 * 0.25 / math.sqrt(3)  # the sample standard deviation of 0.5, 0.75, 1.0 is 0.25
    assert interval.mean == pytest.approx(0.75) and interval.n == 3
    assert (interval.low, interval.high) == (pytest.approx(0.75 - half), pytest.approx(0.75 + half))


def test_equal_values_make_a_point_interval() -> None:
    assert mean_interval([0.25, 0.25]) == Interval(0.25, 0.25, 0.25, 2)


def test_one_value_has_no_interval() -> None:
    with pytest.raises(ValueError, match="at least 2 values"):
        mean_interval([0.5])


def test_a_paired_difference_removes_what_the_pairs_share() -> None:
    trained, frozen = [0.25, 0.5, 0.75], [0.0, 0.25, 0.5]  # far apart per arm, always +0.25 per pair
    assert mean_interval(trained).low < mean_interval(frozen).high
    assert paired_difference(trained, frozen) == Interval(0.25, 0.25, 0.25, 3)


def test_a_paired_difference_needs_pairs() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([0.5, 0.5], [0.5])


def test_an_interval_is_above_a_value_only_when_its_lower_bound_is() -> None:
    assert Interval(0.2, 0.05, 0.35, 3).above(0.0)
    assert not Interval(0.2, -0.05, 0.45, 3).above(0.0)
    assert not Interval(0.2, 0.0, 0.4, 3).above(0.0)  # touching 0 is not above it


def test_an_interval_must_hold_its_mean() -> None:
    with pytest.raises(ValueError, match="must hold its mean"):
        Interval(0.5, 0.6, 0.7, 3)


def test_an_interval_reads_as_mean_and_bounds() -> None:
    assert Interval(0.62, 0.51, 0.73, 3).text() == "0.62 [0.51, 0.73]"
    assert Interval(0.22, 0.08, 0.36, 3).text(signed=True) == "+0.22 [+0.08, +0.36]"
    assert Interval(0.22, 0.08, 0.36, 3).as_dict() == {"mean": 0.22, "low": 0.08, "high": 0.36, "n": 3}
