"""The simulation behind `eldr report`'s verdict: the setup every run shares and the study (per seed, a
capacity search per router, then every router at 10/25/50/75/100% of the best load balancer's mean capacity).
Every number here is SIMULATED.

A :class:`ReportPlan` (the report's inputs, read, and the user's choices, resolved) becomes a :class:`SimSetup`
(:func:`build_setup`: the trace replay, the served rows, the routing objects, the topology, the windows, the
arrivals' burstiness), from which :func:`run_study` returns a :class:`Study`. All three are frozen values; the
only thing that changes while a report runs is its :class:`RunTally`.

Runs call :func:`eldr_cli.simulator.cluster.simulate_run` as a library, one (router, rate, seed) at a time,
on the arrivals of :class:`eldr_cli.bench.workload.ScaledArrivals` (one per seed, shared by every router
and rate). A run measures the requests sent after the warm-up; its window is long enough for
``MIN_REQUESTS`` of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.report.capacity import SLO, Capacity, find_capacity
from eldr_cli.routing import LOAD_BALANCERS

if TYPE_CHECKING:
    from eldr_cli.artifacts.trace import Trace
    from eldr_cli.bench.workload import PromptItem, ScaledArrivals
    from eldr_cli.costmodel import CostModel
    from eldr_cli.routing import RoutingModel
    from eldr_cli.simulator.replay import TraceReplay

LOAD_POINTS_PCT = (10, 25, 50, 75, 100)  # % of the best load balancer's capacity
MIN_REQUESTS = 300
MAX_REQUESTS = 2000
MIN_WARMUP_REQUESTS = 100
MAX_WARMUP_REQUESTS = 2000
METRICS = ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p90_ms", "active_experts",
           "decode_batch")


@dataclass(frozen=True, eq=False)
class ReportPlan:
    """What one report simulates: its input artifacts (read) and the user's choices (resolved)."""

    trace: Path | str            # the trace artifact (as given: report.json states it)
    tr: Trace                    # ... read
    routing: Path                # the fit or routing artifact
    cost_model: Path             # the cost-model artifact
    cost: CostModel              # ... loaded
    split: str                   # the trace rows served
    n_decode: int
    max_tokens: int              # decode tokens per request
    duration_s: float            # the shortest measured window asked for (0: the default)
    seeds: tuple[int, ...]       # seed, seed + 1, ...
    slo_tpot_ms: float | None = None   # None: derived from the cost model
    slo_ttft_ms: float | None = None
    prefill: int | None = None         # None: sized so that TTFT does not bind


@dataclass(frozen=True, eq=False)
class SimSetup:
    """What every run shares: the trace replay, the served rows, the routing objects and the topology."""

    replay: TraceReplay
    items: list[PromptItem]
    rows: np.ndarray             # trace row of each item
    model: RoutingModel
    oracle: Any                  # the step-cluster oracle (routing.oracle.fit_oracle)
    n_prefill: int
    n_decode: int
    max_tokens: int
    duration_s: float            # the shortest measured window
    warmup_s: float
    burstiness: float = 1.0  # gamma shape of the arrival gaps (1: Poisson; a decision log's is fitted to it)

    def window(self, rate: float) -> tuple[float, float]:
        """(warm-up, measured) seconds at ``rate``: the warm-up holds MIN_WARMUP_REQUESTS to MAX_WARMUP_REQUESTS
        (a loose TPOT target must not make it hours long), the measured window MIN_REQUESTS to MAX_REQUESTS."""
        warm = min(self.warmup_s, MAX_WARMUP_REQUESTS / rate)
        window = min(self.duration_s, MAX_REQUESTS / rate)
        return max(warm, MIN_WARMUP_REQUESTS / rate), max(window, MIN_REQUESTS / rate)

    def arrivals(self, seed: int) -> ScaledArrivals:
        """Seed ``seed``'s arrival process, shared by every router and rate of that seed."""
        from eldr_cli.bench.workload import ScaledArrivals

        return ScaledArrivals(len(self.items), seed=seed, burstiness=self.burstiness)


@dataclass
class RunTally:
    """The simulated runs of one report and their wall time (the one mutable part of a study)."""

    runs: int = 0
    sim_s: float = 0.0


@dataclass(frozen=True)
class LoadRuns:
    """Every seed's run of one router at one load point (``seeds``: one run's metrics per seed)."""

    load_pct: int
    rate_rps: float
    router: str
    seeds: list[dict]


@dataclass(frozen=True)
class Study:
    """The capacity per (router, seed), the best load balancer, and every router at each load point."""

    capacity: dict[str, list[Capacity]]
    best_lb: str
    base_rps: float = 0.0        # the best load balancer's mean capacity: the load points' 100%
    by_load: list[LoadRuns] = field(default_factory=list)
    status: str = "ok"           # "ok", "none" (no router met the SLO), "above" (every router met it throughout)
    runs: int = 0                # simulated runs so far (the tally when the study ended)
    sim_s: float = 0.0

    def rates(self, router: str) -> list[float]:
        """``router``'s capacity per seed (req/s)."""
        return [c.rate for c in self.capacity[router]]

    def seed_values(self, pct: int, router: str, key: str) -> list:
        """``router``'s metric ``key`` per seed at load point ``pct`` ([] when it was not run there)."""
        for row in self.by_load:
            if row.load_pct == pct and row.router == router:
                return [m.get(key) for m in row.seeds]
        return []


def build_setup(plan: ReportPlan, notes: list[str]) -> tuple[SimSetup, SLO, float, float]:
    """(setup, SLO, the decoders' estimated best rate under it, the typical prefill step in ms): the shared inputs
    of every run, the SLO and the prefill pool (sized so TTFT does not bind; ``notes`` says so)."""
    from eldr_cli.pipeline.simulate import check_compatible, check_cost_model, trace_items
    from eldr_cli.report.capacity import (
        batch1_steps_ms,
        decode_rate_bound,
        default_prefill,
        default_slo,
        typical_steps_ms,
    )
    from eldr_cli.routing import RoutingModel
    from eldr_cli.routing.oracle import fit_oracle
    from eldr_cli.simulator.replay import TraceReplay

    tr = plan.tr
    replay = TraceReplay(tr, plan.cost)
    model = RoutingModel.load(plan.routing)
    check_compatible(replay, model)
    check_cost_model(replay, plan.cost_model)
    items, rows = trace_items(replay, plan.split)
    if not items:
        raise EldrError(f"the trace has no {plan.split!r} rows to serve")
    steps = batch1_steps_ms(replay, rows, plan.max_tokens)
    slo = default_slo(replay, rows, plan.max_tokens, plan.slo_tpot_ms, plan.slo_ttft_ms, steps=steps)
    ctx = float(np.median(replay.prompt_tokens[rows])) + plan.max_tokens / 2.0
    bound = decode_rate_bound(replay, plan.n_decode, plan.max_tokens, slo.tpot_p90_ms, context=ctx)
    _, prefill_ms = typical_steps_ms(replay, rows, plan.max_tokens, steps=steps)
    n_prefill = plan.prefill or default_prefill(prefill_ms, bound, plan.n_decode)
    if plan.prefill is None:
        notes.append(f"prefill workers: {n_prefill}, sized to be at most 35% busy at {bound:.3g} req/s (the "
                     "decoders' estimated best rate under the TPOT target, at most 16 per decoder), so that TTFT "
                     "does not limit capacity")
    oracle = fit_oracle(tr.decode_counts, rows, plan.n_decode, model=model, seed=plan.seeds[0],
                        decode_steps=tr.decode_steps)
    # a request's lifetime at the TPOT target: the warm-up is two (the decoders' batches reach steady state),
    # the measured window at least three (and at least 300 requests, see SimSetup.window)
    lifetime = plan.max_tokens * slo.tpot_p90_ms / 1e3
    setup = SimSetup(replay, items, rows, model, oracle, n_prefill, plan.n_decode, plan.max_tokens,
                     max(plan.duration_s, 3.0 * lifetime), 2.0 * lifetime,
                     burstiness=float(tr.manifest.get("params", {}).get("arrival_burstiness", 1.0)))
    return setup, slo, bound, prefill_ms


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


def measure(setup: SimSetup, arrivals: ScaledArrivals, router: str, rate: float, seed: int,
            tally: RunTally | None = None) -> dict:
    """One SIMULATED run of ``router`` at ``rate`` on seed ``seed``'s arrivals (counted in ``tally``)."""
    from eldr_cli.simulator.cluster import simulate_run

    warm, dur = setup.window(rate)
    sched = arrivals.schedule(rate, duration_s=dur, warmup_s=warm)
    t0 = time.perf_counter()
    cols, steps, _ = simulate_run(setup.replay, setup.items, sched, router=router, n_prefill=setup.n_prefill,
                                  n_decode=setup.n_decode, max_tokens=setup.max_tokens, model=setup.model,
                                  seed=seed, item_rows=setup.rows, oracle=setup.oracle)
    if tally is not None:
        tally.runs += 1
        tally.sim_s += time.perf_counter() - t0
    return {"router": router, "rate_rps": float(rate), "seed": int(seed),
            **run_metrics(cols, steps, setup.replay.n_layers)}


def best_load_balancer(capacity: dict[str, list[Capacity]]) -> str:
    lbs = [r for r in capacity if r in LOAD_BALANCERS]
    if not lbs:
        raise EldrError("the report needs at least one load balancer (round-robin, random, jsq or p2c) among "
                        "the routers")
    return max(lbs, key=lambda r: (float(np.mean([c.rate for c in capacity[r]])), -lbs.index(r)))


def run_study(setup: SimSetup, routers: list[str], seeds: list[int], slo: SLO, start_rps: float,
              tally: RunTally | None = None, progress: Callable[[str], None] | None = None) -> Study:
    """Capacity per (router, seed), the best load balancer, then every router at each load point."""
    say = progress or (lambda s: None)
    tally = tally if tally is not None else RunTally()
    arrivals = {s: setup.arrivals(s) for s in seeds}
    capacity: dict[str, list[Capacity]] = {r: [] for r in routers}
    for s in seeds:
        for r in routers:
            say(f"capacity: {r}, seed {s}")

            def check(rate: float, r: str = r, s: int = s) -> tuple[bool, str | None]:
                return slo.check(measure(setup, arrivals[s], r, rate, s, tally))

            capacity[r].append(find_capacity(check, start_rps))
    best = best_load_balancer(capacity)
    status = study_status(capacity)
    base = float(np.mean([c.rate for c in capacity[best]]))
    by_load: list[LoadRuns] = []
    if status == "ok" and base > 0:  # "above": the capacities are lower bounds, their fractions mean nothing
        for pct in LOAD_POINTS_PCT:
            rate = base * pct / 100.0
            for r in routers:
                say(f"load {pct}%: {r}")
                by_load.append(LoadRuns(pct, rate, r, [measure(setup, arrivals[s], r, rate, s, tally)
                                                       for s in seeds]))
    return Study(capacity, best, base, by_load, status, tally.runs, tally.sim_s)


def run_sized_study(setup: SimSetup, routers: list[str], seeds: list[int], slo: SLO, start_rps: float,
                    prefill_ms: float | None, notes: list[str],
                    tally: RunTally | None = None) -> tuple[Study, SimSetup]:
    """The study, and the setup it ran on; with a defaulted prefill pool (``prefill_ms`` given), redone with
    more prefill workers (sized for twice the highest capacity found) while TTFT is what limits some router's
    capacity (``notes`` says so)."""
    from eldr_cli.report.capacity import default_prefill

    tally = tally if tally is not None else RunTally()
    for _ in range(3):
        study = run_study(setup, routers, seeds, slo, start_rps, tally)
        ttft = [r for r, cs in study.capacity.items() if [c.binding for c in cs].count("ttft") * 2 > len(cs)]
        if prefill_ms is None or not ttft:
            break
        top = max(c.rate for cs in study.capacity.values() for c in cs)
        more = default_prefill(prefill_ms, 2.0 * top, setup.n_decode)
        if more <= setup.n_prefill:
            break
        notes.append(f"TTFT limited the capacity of {', '.join(ttft)} with {setup.n_prefill} prefill workers: "
                     f"redone with {more} (at most 35% busy at {2 * top:.3g} req/s)")
        setup = replace(setup, n_prefill=more)
    return study, setup


def study_status(capacity: dict[str, list[Capacity]]) -> str:
    """"ok"; "none" when no router met the SLO at any rate tried (on any seed); "above" when every router
    met it at the highest rate tried (on every seed): then capacities are lower bounds."""
    every = [c for cs in capacity.values() for c in cs]
    if all(c.status == "none" for c in every):
        return "none"
    if all(c.status == "above" for c in every):
        return "above"
    return "ok"
