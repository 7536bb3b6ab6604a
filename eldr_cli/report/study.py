"""The simulator runs behind `eldr report`'s verdict: per seed, a capacity search per router, then every
router at 25/50/75/100% of the best load balancer's mean capacity. Every number here is SIMULATED.

Runs call :func:`eldr_cli.simulator.cluster.simulate_run` as a library, one (router, rate, seed) at a time,
on the arrivals of :class:`eldr_cli.bench.workload.ScaledArrivals` (one per seed, shared by every router
and rate). A run measures the requests sent after the warm-up; its window is long enough for
``MIN_REQUESTS`` of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.report.capacity import LOAD_BALANCERS, SLO, Capacity, find_capacity

if TYPE_CHECKING:
    from eldr_cli.simulator.replay import TraceReplay

LOAD_POINTS_PCT = (10, 25, 50, 75, 100)  # % of the best load balancer's capacity
MIN_REQUESTS = 300
MAX_REQUESTS = 2000
MIN_WARMUP_REQUESTS = 100
MAX_WARMUP_REQUESTS = 2000
METRICS = ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p90_ms", "active_experts",
           "decode_batch")


@dataclass
class SimSetup:
    """What every run shares: the trace replay, the served rows, the routing objects and the topology."""

    replay: TraceReplay
    items: list
    rows: np.ndarray
    model: Any
    oracle: Any
    n_prefill: int
    n_decode: int
    max_tokens: int
    duration_s: float
    warmup_s: float
    runs: int = 0
    sim_s: float = 0.0
    burstiness: float = 1.0  # gamma shape of the arrival gaps (1: Poisson; a decision log's is fitted to it)

    def window(self, rate: float) -> tuple[float, float]:
        """(warm-up, measured) seconds at ``rate``: the warm-up holds MIN_WARMUP_REQUESTS to MAX_WARMUP_REQUESTS
        (a loose TPOT target must not make it hours long), the measured window MIN_REQUESTS to MAX_REQUESTS."""
        warm = min(self.warmup_s, MAX_WARMUP_REQUESTS / rate)
        window = min(self.duration_s, MAX_REQUESTS / rate)
        return max(warm, MIN_WARMUP_REQUESTS / rate), max(window, MIN_REQUESTS / rate)


def run_metrics(cols: dict, steps: dict, n_layers: int) -> dict:
    """Percentiles of the measured (post-warm-up) requests of one run, and its mean decode step facts."""
    meas = ~np.asarray(cols["warmup"], dtype=bool)
    tpot = np.asarray(cols["tpot_ms"], dtype=float)[meas]
    ttft = np.asarray(cols["ttft_ms"], dtype=float)[meas]
    tpot, ttft = tpot[np.isfinite(tpot)], ttft[np.isfinite(ttft)]
    out: dict = {k: None for k in METRICS}
    if tpot.size:
        out.update(zip(("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"),
                       map(float, np.percentile(tpot, [50, 90, 99])), strict=True))
    if ttft.size:
        out.update(zip(("ttft_p50_ms", "ttft_p90_ms"), map(float, np.percentile(ttft, [50, 90])), strict=True))
    w = np.asarray(steps["measured_itls"]) > 0
    if w.any():
        out["active_experts"] = float(np.asarray(steps["active_experts"])[w].mean() / n_layers)
        out["decode_batch"] = float(np.asarray(steps["batch"])[w].mean())
    out["requests"] = int(meas.sum())
    return out


def measure(setup: SimSetup, arrivals, router: str, rate: float, seed: int) -> dict:
    """One SIMULATED run of ``router`` at ``rate`` on seed ``seed``'s arrivals."""
    from eldr_cli.simulator.cluster import simulate_run

    warm, dur = setup.window(rate)
    sched = arrivals.schedule(rate, duration_s=dur, warmup_s=warm)
    t0 = time.perf_counter()
    cols, steps, _ = simulate_run(setup.replay, setup.items, sched, router=router, n_prefill=setup.n_prefill,
                                  n_decode=setup.n_decode, max_tokens=setup.max_tokens, model=setup.model,
                                  seed=seed, item_rows=setup.rows,
                                  oracle=setup.oracle)
    setup.runs += 1
    setup.sim_s += time.perf_counter() - t0
    return {"router": router, "rate_rps": float(rate), "seed": int(seed),
            **run_metrics(cols, steps, setup.replay.n_layers)}


def best_load_balancer(capacity: dict[str, list[Capacity]]) -> str:
    lbs = [r for r in capacity if r in LOAD_BALANCERS]
    if not lbs:
        raise EldrError("the report needs at least one load balancer (round-robin, random, jsq or p2c) among "
                        "the routers")
    return max(lbs, key=lambda r: (float(np.mean([c.rate for c in capacity[r]])), -lbs.index(r)))


def run_study(setup: SimSetup, routers: list[str], seeds: list[int], slo: SLO, start_rps: float,
              progress: Callable[[str], None] | None = None) -> dict:
    """Capacity per (router, seed), the best load balancer, then every router at each load point.

    Returns {"capacity": {router: [Capacity per seed]}, "best_lb", "base_rps", "by_load":
    [{load_pct, rate_rps, router, seeds: [metrics per seed]}], "status", "runs", "sim_s"}."""
    from eldr_cli.bench.workload import ScaledArrivals

    say = progress or (lambda s: None)
    arrivals = {s: ScaledArrivals(len(setup.items), seed=s, burstiness=setup.burstiness) for s in seeds}
    capacity: dict[str, list[Capacity]] = {r: [] for r in routers}
    for s in seeds:
        for r in routers:
            say(f"capacity: {r}, seed {s}")

            def check(rate: float, r: str = r, s: int = s) -> tuple[bool, str | None]:
                return slo.check(measure(setup, arrivals[s], r, rate, s))

            capacity[r].append(find_capacity(check, start_rps))
    best = best_load_balancer(capacity)
    status = study_status(capacity)
    base = float(np.mean([c.rate for c in capacity[best]]))
    by_load: list[dict] = []
    if status == "ok" and base > 0:  # "above": the capacities are lower bounds, their fractions mean nothing
        for pct in LOAD_POINTS_PCT:
            rate = base * pct / 100.0
            for r in routers:
                say(f"load {pct}%: {r}")
                by_load.append({"load_pct": pct, "rate_rps": rate, "router": r,
                                "seeds": [measure(setup, arrivals[s], r, rate, s) for s in seeds]})
    return {"capacity": capacity, "best_lb": best, "base_rps": base, "by_load": by_load, "status": status,
            "runs": setup.runs, "sim_s": setup.sim_s}


def study_status(capacity: dict[str, list[Capacity]]) -> str:
    """"ok"; "none" when no router met the SLO at any rate tried (on any seed); "above" when every router
    met it at the highest rate tried (on every seed): then capacities are lower bounds."""
    every = [c for cs in capacity.values() for c in cs]
    if all(c.status == "none" for c in every):
        return "none"
    if all(c.status == "above" for c in every):
        return "above"
    return "ok"
