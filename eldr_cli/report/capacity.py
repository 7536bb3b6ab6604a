"""Capacity at SLO (goodput), paired across seeds: the numbers `eldr report` bets GPUs on.

- **Statistics.** Every figure is measured once per seed (arrival schedule, served-row order, the randomized
  policies' seeds); routers share a seed's arrivals, so a comparison is the mean of the *paired* per-seed
  differences with a 95% Student-t interval (n-1 degrees of freedom, :mod:`eldr_cli.stats`). An interval
  that spans 0 is "no measurable difference".
- **Capacity search.** Per router and seed: the highest request rate at which TPOT p90 <= the TPOT target
  and TTFT p90 <= the TTFT target. From a starting rate, double (or halve) until the SLO flips, then bisect
  (geometric midpoint) until the bracket [lo, hi) satisfies hi <= 1.02 lo; the capacity is lo, the highest
  rate seen to hold. The seed's threshold lies in [lo, hi), so the search under-states it by less than 2%.
  (Rates share one scaled arrival process per seed, see ``ScaledArrivals``, so the SLO check changes with
  load and nothing else.)
- **SLO defaults** come from the cost model (:func:`default_slo`), the prefill pool from the decoders' best
  possible rate under that SLO (:func:`default_prefill`), so TTFT is not what limits capacity by design.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing import LOAD_BALANCERS

ORACLE = "oracle"             # the step-cluster oracle (routing.oracle)
CLAIRVOYANT = "clairvoyant"   # eldr-live's rule on true future activations (routing.clairvoyant): the limit
LIMITS = (ORACLE, CLAIRVOYANT)
CI_METHOD = "95% Student-t interval over seeds (n-1 degrees of freedom), paired across routers"
TOLERANCE = 0.02          # bisect until hi <= (1 + TOLERANCE) * lo
MAX_DOUBLINGS = 5         # highest rate tried: start * 2**5
MAX_HALVINGS = 10         # lowest rate tried: start / 2**10
TPOT_SLO_FACTOR = 4.0     # TPOT target: 4x the batch-1 decode step at the typical context
TTFT_SLO_FACTOR = 3.0     # TTFT target: 3x the p90 prompt's prefill step + 2 TPOT targets
TTFT_SLO_QUANTILE = 0.9   # the target bounds TTFT's p90, so it is derived from the p90 prompt's prefill


def is_candidate(router: str) -> bool:
    """A router compared against the best load balancer: anything that is neither a balancer nor a limit row
    (the step-cluster oracle, the clairvoyant router: they know the future)."""
    return router not in LOAD_BALANCERS and router not in LIMITS


# -- capacity search -----------------------------------------------------------------------------------

@dataclass
class Capacity:
    """One (router, seed) search: ``rate`` = highest rate that held (0 when none did), ``status``
    "found", "none" (even the lowest rate tried failed) or "above" (the highest rate tried held)."""

    rate: float
    status: str
    lo: float | None
    hi: float | None
    binding: str | None = None   # the SLO that failed at hi: "tpot" or "ttft"
    probes: list[tuple[float, bool]] = field(default_factory=list)


def find_capacity(check: Callable[[float], tuple[bool, str | None]], start: float, *,
                  tolerance: float = TOLERANCE) -> Capacity:
    """Highest rate with ``check(rate)[0]`` true: bracket by doubling/halving from ``start``, then bisect
    geometrically until ``hi <= (1 + tolerance) * lo``. ``check`` returns (holds, the failing SLO)."""
    if not start > 0:
        raise EldrError(f"the capacity search needs a positive starting rate, got {start}")
    probes: list[tuple[float, bool]] = []
    why: dict[float, str | None] = {}

    def probe(r: float) -> bool:
        ok, bad = check(r)
        probes.append((r, bool(ok)))
        why[r] = bad
        return bool(ok)

    lo: float | None = None
    hi: float | None = None
    if probe(start):
        lo = start
        for _ in range(MAX_DOUBLINGS):
            r = lo * 2.0
            if not probe(r):
                hi = r
                break
            lo = r
        if hi is None:
            return Capacity(lo, "above", lo, None, None, probes)
    else:
        hi = start
        for _ in range(MAX_HALVINGS):
            r = hi / 2.0
            if probe(r):
                lo = r
                break
            hi = r
        if lo is None:
            return Capacity(0.0, "none", None, hi, why[hi], probes)
    while hi > (1.0 + tolerance) * lo:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, "found", lo, hi, why[hi], probes)


@dataclass(frozen=True)
class SLO:
    tpot_p90_ms: float
    ttft_p90_ms: float
    how: str = "given"

    def check(self, m: dict) -> tuple[bool, str | None]:
        """(holds, the SLO that fails worst) for one run's metrics."""
        tp, tt = m.get("tpot_p90_ms"), m.get("ttft_p90_ms")
        if tp is None or tt is None or not (math.isfinite(tp) and math.isfinite(tt)):
            return False, "tpot"
        over = {"tpot": tp / self.tpot_p90_ms, "ttft": tt / self.ttft_p90_ms}
        worst = max(over, key=lambda k: over[k])
        return over[worst] <= 1.0, (worst if over[worst] > 1.0 else None)


def check_slo_values(tpot_ms: float | None, ttft_ms: float | None, seeds: int) -> None:
    """The bad-input rules of `eldr report`, checked before anything is read or written."""
    if seeds < 1:
        raise EldrError(f"--seeds must be >= 1 (got {seeds})")
    for flag, v in (("--slo-tpot-ms", tpot_ms), ("--slo-ttft-ms", ttft_ms)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise EldrError(f"{flag} must be a positive number of milliseconds (got {v})")


def round_sig(x: float, digits: int = 2) -> float:
    """``x`` to ``digits`` significant digits (an SLO reads as 60 ms, not 58.05 ms)."""
    if x <= 0 or not math.isfinite(x):
        return x
    return float(round(x, digits - 1 - int(math.floor(math.log10(x)))))


def typical_steps_ms(replay, rows: np.ndarray, max_tokens: int,
                     steps: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float]:
    """(batch-1 decode step, batch-1 prefill step) in ms, medians over the served rows: a decode step of
    one request at its mid-decode context (prompt + max_tokens / 2), the prefill of its whole prompt
    (``steps``: :func:`batch1_steps_ms`'s answer for the same arguments, when the caller has it)."""
    dec, pre = steps if steps is not None else batch1_steps_ms(replay, rows, max_tokens)
    return float(np.median(dec)), float(np.median(pre))


def batch1_steps_ms(replay, rows: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Each served row's batch-1 decode step (mid-decode context) and batch-1 prefill step, in ms."""
    u = np.unique(np.asarray(rows, dtype=np.int64))
    top_k = int(replay.trace.model.get("top_k") or 1)
    active = top_k * replay.n_layers
    dec = [replay.cost.step_ms(replay.cost.spread_active(active), replay.n_layers, 1, replay.token_scale,
                               context=[float(replay.prompt_tokens[r]) + max_tokens / 2.0]) for r in u]
    pre = [replay.prefill_step_ms([int(r)])[0] for r in u]
    return np.asarray(dec, dtype=np.float64), np.asarray(pre, dtype=np.float64)


def default_slo(replay, rows: np.ndarray, max_tokens: int, tpot_ms: float | None = None,
                ttft_ms: float | None = None, steps: tuple[np.ndarray, np.ndarray] | None = None) -> SLO:
    """The SLO of the report: the values given, else derived from the cost model and stated.

    The TTFT target bounds TTFT's p90, so it comes from the p90 prompt's prefill. From the median prompt's, a
    trace with a long tail of prompts nearly misses it at 10% load, and capacity then measures that tail, not
    the decoders (on a captured trace, ~10 ms of median TTFT moved a router's capacity by 11%). ``steps``: as for
    :func:`typical_steps_ms`."""
    dec_all, pre_all = steps if steps is not None else batch1_steps_ms(replay, rows, max_tokens)
    dec = float(np.median(dec_all))
    pre = float(np.quantile(pre_all, TTFT_SLO_QUANTILE))
    tpot = tpot_ms or round_sig(TPOT_SLO_FACTOR * dec)
    ttft = ttft_ms or round_sig(TTFT_SLO_FACTOR * pre + 2.0 * tpot)
    parts = []
    if not tpot_ms:
        parts.append(f"TPOT target = {TPOT_SLO_FACTOR:g} x the batch-1 decode step at the typical context "
                     f"({dec:.1f} ms), rounded")
    if not ttft_ms:
        parts.append(f"TTFT target = {TTFT_SLO_FACTOR:g} x the p{round(100 * TTFT_SLO_QUANTILE)} prompt's prefill "
                     f"step ({pre:.1f} ms) + 2 TPOT targets, rounded")
    return SLO(float(tpot), float(ttft), "; ".join(parts) or "given")


def decode_rate_bound(replay, n_decode: int, max_tokens: int, tpot_ms: float, max_seqs: int = 256,
                      context: float = 0.0) -> float:
    """Requests/s that ``n_decode`` decoders could carry with their step at the TPOT target: the largest batch
    whose step (uniformly random experts, the mid-decode context) fits it. An estimate for sizing, not a result."""
    L, E = replay.n_layers, replay.num_experts
    k = int(replay.trace.model.get("top_k") or 1)
    best = 1.0
    for b in range(1, max_seqs + 1):
        active = L * E * (1.0 - (1.0 - min(k, E) / E) ** b)
        ms = replay.cost.step_ms(replay.cost.spread_active(active), L, b, replay.token_scale, context=[context] * b)
        if ms > tpot_ms:
            break
        best = n_decode * b * 1000.0 / (ms * max(max_tokens, 1))
    return best


def default_prefill(prefill_ms: float, rate_bound: float, n_decode: int, utilisation: float = 0.35) -> int:
    """Prefill workers that are at most ``utilisation`` busy (one prompt per step, no batching gains) at the
    decoders' best possible rate: enough that TTFT is not what limits capacity; at most 16 per decoder."""
    return max(1, min(16 * n_decode, math.ceil(rate_bound * prefill_ms / 1000.0 / utilisation)))
