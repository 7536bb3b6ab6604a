"""Discrete-event simulator of an xPyD cluster (`eldr bench simulate`): the same traces, cost model,
arrival schedules and routing objects as the emulated cluster, in virtual time, no HTTP.

- prefill: PrefixHash with least-loaded fallback (``routing.prefill.PrefixHashPrefill``, the proxy's own), FIFO
  batches up to a token budget, step time from the cost model over the batch's prompt experts;
- handoff: the proxy's in-flight decode counts are the loads; the decode router of
  ``eldr_cli.routing.make_router`` (the proxy's own object) chooses the decode worker from the
  request's prefill counts, its domain and the loads;
- decode: continuous batching with replayed per-step expert picks (eldr_cli/simulator/core.py).

The event loop of one (router, rate) run is :func:`eldr_cli.simulator.cluster.simulate_run`; this module
turns a sweep of them into a bench artifact.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from eldr_cli.bench.workload import PromptItem, build_schedule, row_ref
from eldr_cli.errors import EldrError
from eldr_cli.routing import LOAD_BALANCERS, ROUTERS
from eldr_cli.simulator.cluster import simulate_run
from eldr_cli.simulator.replay import TraceReplay


def check_compatible(replay: TraceReplay, model) -> None:
    if model is not None and tuple(model.shape) != (replay.n_layers, replay.num_experts):
        raise EldrError(f"the trace has L={replay.n_layers}, E={replay.num_experts} but the routing artifact "
                        f"expects {model.shape[0]}x{model.shape[1]}",
                        hint="fit the routing artifact on a trace of the same model")


def trace_items(replay: TraceReplay, split: str | None) -> tuple[list[PromptItem], np.ndarray]:
    """The rows of ``split`` as requests: (items, trace row of each item). A row without prompt text
    (imported traces carry none) is keyed by its row id, so PrefixHash prefill still spreads them."""
    tr = replay.trace
    rows = np.flatnonzero(tr.split_mask(split))
    cols = tr.requests.columns
    texts = tr.column("prompt") if "prompt" in cols else [None] * tr.n_requests
    doms = tr.column("domain") if "domain" in cols else [None] * tr.n_requests
    ids = tr.column("request_id") if "request_id" in cols else np.arange(tr.n_requests)
    items = [PromptItem(str(texts[r]) if texts[r] else row_ref(ids[r]),
                        str(doms[r]) if doms[r] is not None else None, str(ids[r])) for r in rows]
    return items, rows.astype(np.int64)


def check_cost_model(replay: TraceReplay, cost_model: str | Path) -> None:
    """A roofline or a measured decode step describes one model: refuse it for a trace of another (L or E)."""
    from eldr_cli.costmodel import check_model

    check_model(cost_model, replay.n_layers, replay.num_experts)


def run_simulate(out: str | Path, *, trace: str | Path, cost_model: str | Path, prompts: str | Path | None = None,
                 split: str = "evaluation", routers: list[str], rates: list[float], n_prefill: int = 8,
                 n_decode: int = 16, duration_s: float = 120.0, warmup_s: float = 30.0, max_tokens: int = 512,
                 burstiness: float = 1.0, routing: str | Path | None = None, tau: float | None = None,
                 seed: int = 0, max_seqs: int = 256, title: str = "", progress=None,
                 workers: int | None = None) -> Path:
    """Simulate every (router, rate) and write a bench artifact with mode=simulated. ``workers``: processes
    for the independent (router, rate) runs (None: up to 2 when the CPU has them and the runs are big
    enough to pay for a fork; each run is seeded on its own, so the result is the same for any value)."""
    import polars as pl

    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.bench.metrics import requests_frame_from_columns, summarize
    from eldr_cli.bench.results import write_bench
    from eldr_cli.bench.workload import load_prompts
    from eldr_cli.costmodel import CostModel
    from eldr_cli.routing import RoutingModel
    from eldr_cli.routing.registry import check_policy

    for r in routers:
        check_policy(r)  # the registry's one message
    if n_prefill < 1 or n_decode < 1 or max_tokens < 1:
        raise EldrError("--prefill, --decode and --max-tokens must be >= 1")
    cost = CostModel.load(cost_model)
    tr = read_trace(trace)
    replay = TraceReplay(tr, cost)
    model = RoutingModel.load(routing) if routing is not None else None
    check_compatible(replay, model)
    check_cost_model(replay, cost_model)
    if model is None and any(r in ("eldr", "eldr-live", "domain") for r in routers):
        raise EldrError("the eldr, eldr-live and domain routers need --routing (a routing or fit artifact)")
    if prompts is not None:
        items, item_rows = load_prompts(prompts), None
    else:  # serve the trace's own rows; prompt text is optional
        items, item_rows = trace_items(replay, split)
    oracle = None
    if "oracle" in routers or "clairvoyant" in routers:
        from eldr_cli.routing.oracle import fit_oracle

        served = item_rows if item_rows is not None else np.array([replay.match(it.prompt)[0] for it in items])
        oracle = fit_oracle(tr.decode_counts, served, n_decode, model=model, tau=tau, seed=seed,
                            decode_steps=tr.decode_steps)
    t0 = time.perf_counter()
    runs, req_rows, step_frames = [], [], []
    scheds = {rate: build_schedule(len(items), rate, duration_s=duration_s, warmup_s=warmup_s,
                                   burstiness=burstiness, seed=seed) for rate in rates}
    tasks = [(rate, router) for rate in rates for router in routers]
    kw: dict = dict(n_prefill=n_prefill, n_decode=n_decode, max_tokens=max_tokens, model=model, tau=tau, seed=seed,
                    max_seqs=max_seqs, item_rows=item_rows, oracle=oracle)
    n_req = sum(len(scheds[r]) for r, _ in tasks)
    for (rate, router), (rows, steps, facts) in zip(tasks, _run_tasks(replay, items, scheds, tasks, kw, workers,
                                                                       n_req), strict=True):
        df = requests_frame_from_columns(rows, len(rows["router"]))
        meas = steps["measured_itls"]
        s = summarize(df, request_rate=rate, router=router, mode="simulated", burstiness=burstiness,
                      itl_values=steps["step_ms"], itl_weights=meas,
                      extra={"mean_active_experts_per_step": float(steps["active_experts"].mean() / replay.n_layers)
                             if len(meas) else None,
                             "mean_decode_batch": float(steps["batch"].mean()) if len(meas) else None,
                             "decode_steps": int(len(meas)), **facts})
        runs.append(s)
        req_rows.append(df)
        step_frames.append(pl.DataFrame({"router": router, "request_rate": float(rate), **steps}))
        if progress:
            progress(router, rate, s)
    wall = time.perf_counter() - t0
    inputs = {"trace": trace, "cost_model": cost_model}
    if routing is not None:
        inputs["routing"] = routing
    if prompts is not None:
        inputs["prompts"] = prompts
    return write_bench(out, mode="simulated", params={
        "prefill_workers": n_prefill, "decode_workers": n_decode, "rates": rates, "duration_s": duration_s,
        "warmup_s": warmup_s, "max_tokens": max_tokens, "burstiness": burstiness, "seed": seed, "tau": tau,
        "max_seqs": max_seqs, "split": split, "trace_model": tr.model.get("model"),
        "workload": "generated trace" if tr.model.get("model") == "synthetic" else "captured trace"},
        runs=runs, requests=pl.concat(req_rows), steps=pl.concat(step_frames), inputs=inputs, title=title,
        n_layers=replay.n_layers, num_experts=replay.num_experts,
        extra={"simulate_wall_s": wall, "oracle_share": oracle_shares(runs)})


_JOB: dict = {}  # the shared inputs of a parallel simulate, inherited by forked workers (not pickled)
PARALLEL_MIN_REQUESTS = 20000


def _run_task(i: int):
    j = _JOB
    rate, router = j["tasks"][i]
    return simulate_run(j["replay"], j["items"], j["scheds"][rate], router=router, **j["kw"])


def _run_tasks(replay, items, scheds, tasks, kw, workers, n_req):
    """Results of the (rate, router) runs in task order, serially or over forked worker processes."""
    import multiprocessing as mp
    import os

    if workers is None:
        workers = min(2, os.cpu_count() or 1) if n_req >= PARALLEL_MIN_REQUESTS else 1
    workers = max(1, min(int(workers), len(tasks)))
    _JOB.update(replay=replay, items=items, scheds=scheds, tasks=tasks, kw=kw)
    try:
        if workers == 1 or "fork" not in mp.get_all_start_methods():
            yield from map(_run_task, range(len(tasks)))
            return
        from concurrent.futures import ProcessPoolExecutor

        # fork: the workers inherit the replay, prompts and compiled loops instead of rebuilding them; they
        # only run numpy, numba and the routing objects (no polars, whose threads do not survive a fork)
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
            yield from ex.map(_run_task, range(len(tasks)))
    finally:
        _JOB.clear()


SIM_POLICIES = ROUTERS


def oracle_shares(runs: list[dict]) -> list[dict]:
    """Per rate and metric: the best load balancer, ELDR, the oracle, and the share (%) of the
    balancer-to-oracle distance ELDR covers (None when a run or the gap is missing)."""
    from eldr_cli.routing.oracle import oracle_share

    out = []
    for rate in sorted({r["request_rate"] for r in runs}):
        at = {r["router"]: r for r in runs if r["request_rate"] == rate}
        if "eldr" not in at or "oracle" not in at:
            continue
        row: dict = {"request_rate": rate}
        for m in ("p50_tpot_ms", "p99_tpot_ms", "mean_active_experts_per_step"):
            lbs = [at[b][m] for b in LOAD_BALANCERS if b in at and at[b].get(m) is not None]
            e, o = at["eldr"].get(m), at["oracle"].get(m)
            if not lbs or e is None or o is None:
                continue
            row[m] = {"best_lb": min(lbs), "eldr": e, "oracle": o, "share_pct": oracle_share(min(lbs), e, o)}
        out.append(row)
    return out
