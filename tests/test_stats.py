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
