"""The shared statistics (eldr_cli.stats): the bootstrap interval of a median."""

from __future__ import annotations

import statistics

import pytest

from eldr_cli.stats import bootstrap_median_ci, paired_diff_ci


def test_bootstrap_median_interval_holds_the_median_and_is_reproducible():
    values = [0.3, -1.2, 2.5, 0.9, 1.1, -0.4, 3.8, 0.2, 1.7, 0.6, -0.9, 1.4]
    lo, hi = bootstrap_median_ci(values, seed=3)
    assert lo <= statistics.median(values) <= hi
    assert min(values) <= lo < hi <= max(values)
    assert bootstrap_median_ci(values, seed=3) == (lo, hi)          # seeded: the same interval again
    assert bootstrap_median_ci([2.0] * 9) == (2.0, 2.0)             # no spread, no width
    wide = bootstrap_median_ci(values * 1, resamples=400)
    narrow = bootstrap_median_ci(values * 8, resamples=400)         # 8x the data: a narrower interval
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    with pytest.raises(ValueError):
        bootstrap_median_ci([])


def test_paired_difference_drops_pairs_with_a_missing_side():
    iv = paired_diff_ci([1.0, None, 3.0, 5.0], [0.0, 2.0, None, 4.0])
    assert iv is not None and iv.n == 2 and iv.mean == pytest.approx(1.0) and iv.lo == iv.hi == pytest.approx(1.0)


def test_welch_interval_by_hand():
    from eldr_cli.stats import welch_diff_ci

    a, b = [5.0, 7.0, 6.0, 8.0], [4.0, 5.0, 3.0]
    iv = welch_diff_ci(a, b)
    # means 6.5 and 4; variances of the means 1.6667/4 = 0.41667 and 1/3; se = 0.86603;
    # df = 0.75^2 / (0.41667^2 / 3 + 0.33333^2 / 2) = 4.9592; t(0.975, 4.9592) = 2.57696
    assert iv.mean == pytest.approx(2.5)
    assert iv.lo == pytest.approx(2.5 - 2.57696 * 0.86603, abs=1e-4)
    assert iv.hi == pytest.approx(2.5 + 2.57696 * 0.86603, abs=1e-4)
    assert welch_diff_ci([1.0], [2.0, 3.0]).lo is None and welch_diff_ci([], [1.0]) is None
