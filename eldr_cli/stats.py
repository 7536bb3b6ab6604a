"""The statistics every comparison in eldr reports: a mean and its 95% interval, paired differences, a bootstrap.

One module for `eldr report` (capacity and TPOT over seeds, paired across routers), the decision-log replay and
the benchmarks (before/after alternations, paired per round), so an interval means the same thing everywhere:

- :func:`mean_ci`: mean of the finite values and its 95% Student-t interval (n-1 degrees of freedom);
- :func:`paired_diff_ci` / :func:`paired_pct_ci`: the same over per-pair differences ``a_i - b_i`` or relative
  changes ``100 (new_i / base_i - 1)``: pairing (one seed's arrivals for both routers, one round for both
  trees) removes the pair's own noise from the comparison;
- :func:`welch_diff_ci`: the difference of two unpaired samples' means (Welch), where nothing pairs them;
- :func:`bootstrap_median_ci`: a percentile-bootstrap interval of the median (seeded, so it is reproducible),
  for skewed samples such as per-request latency differences.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
T_QUANTILE = 0.975  # two-sided 95%


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and its 95% t-interval (``lo``/``hi`` None with fewer than two values)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int

    @property
    def spans_zero(self) -> bool:
        return self.lo is None or self.hi is None or (self.lo <= 0.0 <= self.hi)

    def as_json(self, digits: int = 3) -> dict:
        def r(x):
            return None if x is None else round(float(x), digits)

        return {"mean": r(self.mean), "ci95": [r(self.lo), r(self.hi)]}

    @classmethod
    def from_json(cls, d: dict | None) -> Interval | None:
        """The interval of a ``{"mean", "ci95"}`` pair as :meth:`as_json` writes it (``n`` is not kept: 0);
        None when there is no mean."""
        if not d or d.get("mean") is None:
            return None
        lo, hi = d.get("ci95") or (None, None)
        return cls(float(d["mean"]), lo, hi, 0)


def interval_json(x: Interval | None, digits: int = 3) -> dict:
    """``x.as_json(digits)``, or the same shape with nulls when there is no interval."""
    return x.as_json(digits) if x is not None else {"mean": None, "ci95": [None, None]}


def mean_ci(values: Sequence[float | None]) -> Interval | None:
    """Mean and 95% Student-t interval of the finite ``values`` (None when there are none)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return None
    m = float(v.mean())
    if v.size < 2:
        return Interval(m, None, None, 1)
    from scipy.stats import t

    half = float(t.ppf(T_QUANTILE, v.size - 1)) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return Interval(m, m - half, m + half, int(v.size))


def paired_diff_ci(a: Sequence[float | None], b: Sequence[float | None]) -> Interval | None:
    """Interval of the per-pair differences a_i - b_i (pairs with a missing side are dropped)."""
    return mean_ci([x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None])


def paired_pct_ci(new: Sequence[float | None], base: Sequence[float | None]) -> Interval | None:
    """Interval of the per-pair relative changes 100 (new_i / base_i - 1), in %."""
    return mean_ci([100.0 * (x / y - 1.0) for x, y in zip(new, base, strict=True)
                    if x is not None and y is not None and y > 0])


def welch_diff_ci(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    """Mean of ``a`` minus mean of ``b`` for two unpaired samples, with its 95% Welch interval (Welch-Satterthwaite
    degrees of freedom); no interval (``lo``/``hi`` None) with fewer than two values on a side or no spread."""
    x = np.asarray([v for v in a if v is not None and math.isfinite(v)], dtype=float)
    y = np.asarray([v for v in b if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0 or y.size == 0:
        return None
    d = float(x.mean() - y.mean())
    if min(x.size, y.size) < 2:
        return Interval(d, None, None, int(min(x.size, y.size)))
    vx, vy = float(x.var(ddof=1)) / x.size, float(y.var(ddof=1)) / y.size
    if vx + vy == 0.0:
        return Interval(d, d, d, int(min(x.size, y.size)))
    from scipy.stats import t

    df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1))
    half = float(t.ppf(T_QUANTILE, df)) * math.sqrt(vx + vy)
    return Interval(d, d - half, d + half, int(min(x.size, y.size)))


def bootstrap_median_ci(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``values``: the medians of ``resamples`` resamples
    with replacement (``random.Random(seed)``), sorted, cut at 2.5% and 97.5%."""
    if not values:
        raise ValueError("bootstrap_median_ci needs at least one value")
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(list(values), k=len(values))) for _ in range(resamples))
    cut = max(1, round(resamples * (1.0 - LEVEL) / 2))
    return boots[cut - 1], boots[resamples - cut - 1]
