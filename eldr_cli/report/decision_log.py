"""`eldr report --decision-log`: the report's verdict on traffic the proxy served, rebuilt from its decision log.

:mod:`eldr_cli.pipeline.decision_replay` turns the log's replay rows into a trace (GENERATED decode picks) and
its arrival process; :func:`run_report_from_log` runs `eldr report` (:func:`eldr_cli.report.run.run_report`) on
that trace, whose verdict is SIMULATED, and adds the logged load and where it sits against the capacities found,
every router at the logged load, the drift verdict and the logged TPOT against the cost model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.pipeline.decision_replay import arrival_facts, read_rows, replay_rows, trace_from_rows


def run_report_from_log(log, out, *, fit, seed: int = 0, **report_kw) -> dict:
    """`eldr report` on the traffic of a decision log (``fit``: the routing artifact that served it). Writes
    ``out`` like :func:`eldr_cli.report.run.run_report` plus a ``decision_log`` section; returns the
    verdict with that section under ``"decision_log"``."""
    import shutil
    import tempfile

    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.proxy.decisionlog import routing_id
    from eldr_cli.report.run import run_report
    from eldr_cli.routing import RoutingModel

    if fit is None:
        raise EldrError("--decision-log needs --fit: the routing artifact the proxy served with")
    out = Path(out)
    check_output(out, "report", [log, fit])
    model = RoutingModel.load(fit)
    rows, skipped = replay_rows(read_rows(log), log, str(routing_id(str(fit))))
    arr = arrival_facts(np.array([r["arrival_s"] for r in rows]))
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.resolve().parent))
    try:
        tr = trace_from_rows(rows, model.shape, seed)
        trace = write_trace(work / "trace", tr, params={"arrival_burstiness": arr["burstiness"],
                                                        "decode_picks": "GENERATED from the logged prefill counts"},
                            inputs={"decision_log": str(log)})
        report_kw.setdefault("decode", model.n_clusters)
        v = run_report(trace, out, fit=fit, seed=seed, split="all", **report_kw)
        at_load = at_logged_load(trace, fit, report_kw.get("cost_model"), out, arr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    section = log_section(v, rows, skipped, arr, log)
    section["at_logged_load"] = at_load
    section["drift"] = log_drift(model, fit, tr.prefill_counts)
    section["logged_tpot"] = logged_tpot(rows, tr, report_kw.get("cost_model"))
    _append(out, section)
    return {**v, "decision_log": section}


def at_logged_load(trace: Path, fit, cost_model, out: Path, arr: dict) -> dict:
    """Every router SIMULATED at the logged rate (the report's seeds, setup and SLO; arrivals of the logged
    gaps' CV, which the rebuilt trace carries): TPOT/TTFT per router with 95% intervals and the paired TPOT
    change against the best load balancer."""
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.costmodel import CostModel
    from eldr_cli.report.study import ReportPlan, build_setup, measure
    from eldr_cli.stats import interval_json, mean_ci, paired_pct_ci

    if cost_model is None:
        return {"note": "give --cost-model to simulate every router at the logged load"}
    doc = json.loads((out / "report.json").read_text())
    sim, v = doc["simulated"], doc["verdict"]
    plan = ReportPlan(trace, read_trace(trace), Path(fit), Path(cost_model), CostModel.load(cost_model), sim["split"],
                      sim["decode"], sim["max_tokens"], float(sim["min_window_s"]), tuple(sim["seeds"]),
                      v["slo"]["tpot_p90_ms"], v["slo"]["ttft_p90_ms"], sim["prefill"])
    setup, _, _, _ = build_setup(plan, [])
    rate, seeds = float(arr["rate_rps"]), list(sim["seeds"])
    runs = {r: [measure(setup, setup.arrivals(s), r, rate, s) for s in seeds] for r in sim["routers"]}
    best = v["best_load_balancer"]
    keys = ("tpot_p50_ms", "tpot_p90_ms", "ttft_p90_ms")
    return {"label": "SIMULATED", "rate_rps": round(rate, 4), "seeds": seeds,
            "by_router": {r: {k: interval_json(mean_ci(_vals(ms, k))) for k in keys} for r, ms in runs.items()},
            "tpot_p50_change_vs_best_lb_pct": {r: interval_json(paired_pct_ci(_vals(ms, "tpot_p50_ms"),
                                                                              _vals(runs[best], "tpot_p50_ms")))
                                               for r, ms in runs.items() if r != best}}


def _vals(runs: list[dict], key: str) -> list[float]:
    """One figure per seed (NaN where a run has none: dropped by the intervals)."""
    return [float("nan") if m.get(key) is None else float(m[key]) for m in runs]


def log_section(v: dict, rows: list[dict], skipped: dict[str, int], arr: dict, log) -> dict:
    """What the decision log adds to the verdict: the rows used and skipped, the logged arrival process and
    the logged load as a share of each router's mean capacity."""
    from eldr_cli.routing import LOAD_BALANCERS

    caps = {r: c.get("mean") for r, c in (v.get("capacity_rps") or {}).items() if isinstance(c, dict)}
    lbs = [c for r, c in caps.items() if r in LOAD_BALANCERS and c]
    share = {r: round(100.0 * arr["rate_rps"] / c, 1) for r, c in caps.items() if c}
    return {"path": str(log), "rows_used": len(rows), "rows_skipped": skipped,
            "policies_logged": sorted({str(r.get("policy")) for r in rows}),
            "logged_rate_rps": round(arr["rate_rps"], 4), "logged_span_s": round(arr["span_s"], 2),
            "arrival_gap_cv": round(arr["gap_cv"], 3), "arrival_burstiness": round(arr["burstiness"], 3),
            "logged_load_pct_of_capacity": share,
            "logged_load_pct_of_best_lb": round(100.0 * arr["rate_rps"] / max(lbs), 1) if lbs else None,
            "decode_picks": "GENERATED from the logged prefill counts (the log holds no decode steps)"}


def logged_tpot(rows: list[dict[str, Any]], tr, cost_model) -> dict[str, Any]:
    """Per decoder: the mean TPOT the proxy scraped from it (``decoders_tpot_ms``, `serve-proxy
    --scrape-metrics`) against the cost model's step time for its mean logged batch (in-flight requests at
    decision time), with the log's mean per-step decode activation (GENERATED decode picks): the model's error
    on the operator's own hardware. A note instead when the log or the report lacks what it needs."""
    if cost_model is None:
        return {"note": "give --cost-model to compare the logged TPOT with the cost model's prediction"}
    got = [r for r in rows if isinstance(r.get("decoders_tpot_ms"), list) and isinstance(r.get("loads"), list)]
    if not got:
        return {"note": "the log holds no scraped TPOT: serve with --scrape-metrics (decoders exporting "
                        "vllm:time_per_output_token_seconds)"}
    from eldr_cli.costmodel import CostModel

    cost = CostModel.load(cost_model)
    steps = np.maximum(np.asarray(tr.decode_steps, dtype=np.float64), 1.0)
    p = np.clip((np.asarray(tr.decode_counts) / steps[:, None, None]).mean(axis=0), 0.0, 1.0)  # [L, E]
    ctx = float(np.mean(tr.prompt_tokens)) + float(np.mean(steps)) / 2.0
    scale = cost.token_scale(tr.top_k)
    out = []
    for k in range(len(got[0]["decoders_tpot_ms"])):
        pairs = [(r["decoders_tpot_ms"][k], r["loads"][k]) for r in got
                 if k < len(r["decoders_tpot_ms"]) and r["decoders_tpot_ms"][k] is not None and k < len(r["loads"])]
        if not pairs:
            continue
        logged = float(np.mean([a for a, _ in pairs]))
        B = max(float(np.mean([b for _, b in pairs])), 1.0)
        active = float((1.0 - (1.0 - p) ** B).sum())
        pred = cost.step_ms(active, tr.num_layers, B, scale, context=[ctx] * int(round(B)))
        out.append({"decoder": k, "rows": len(pairs), "mean_batch": round(B, 2), "logged_tpot_ms": round(logged, 3),
                    "predicted_tpot_ms": round(pred, 3), "error_pct": round(100.0 * (logged - pred) / pred, 1)})
    if not out:
        return {"note": "no decoder's TPOT was scraped while the log was written"}
    return {"per_decoder": out, "mean_abs_error_pct": round(float(np.mean([abs(x["error_pct"]) for x in out])), 1),
            "how": "predicted: the cost model's step at each decoder's mean logged in-flight count, with the log's "
                   "mean decode activation (GENERATED from prefill counts)"}


def log_drift(model, fit, counts: np.ndarray) -> dict:
    """The drift verdict over every replayed request (one window of the whole log), see routing.drift."""
    from eldr_cli.routing.drift import DriftMonitor
    from eldr_cli.routing.model import load_routing_artifact

    stats = load_routing_artifact(fit).params.get("drift")
    mon = DriftMonitor.for_model(model, stats, window=len(counts))
    mon.observe_many(np.stack([model.signature(c) for c in counts]))
    return mon.snapshot()


def _append(out: Path, section: dict) -> None:
    """Add the section to report.json and report.md (written by run_report into ``out``)."""
    j = out / "report.json"
    doc = json.loads(j.read_text())
    doc["decision_log"] = section
    j.write_text(json.dumps(doc, indent=2, default=str))
    sk = ", ".join(f"{v} {k}" for k, v in section["rows_skipped"].items() if v) or "none"
    lines = ["", "## Served traffic (decision log)", "",
             f"- log: `{section['path']}`; rows replayed: {section['rows_used']}; skipped: {sk}",
             f"- logged load: {section['logged_rate_rps']:.3g} req/s over {section['logged_span_s']:.0f} s "
             f"(arrival gaps CV {section['arrival_gap_cv']:.2f}; each seed draws a gamma process of that CV)",
             f"- logged load as % of each router's SIMULATED capacity: {section['logged_load_pct_of_capacity']}",
             f"- at the logged load (SIMULATED): {_at_load_text(section.get('at_logged_load') or {})}",
             f"- drift: {_drift_text(section['drift'])}",
             f"- decode picks: {section['decode_picks']}", f"- logged TPOT vs the cost model: {_tpot_text(section)}",
             ""]
    with open(out / "report.md", "a") as fh:
        fh.write("\n".join(lines))


def _drift_text(d: dict) -> str:
    if d.get("drifted") is None:
        return "no verdict (" + "; ".join(d.get("reasons") or ["too few requests"]) + ")"
    sim = f"mean similarity to the nearest centroid {d['centroid_similarity']:.3f}"
    if not d["drifted"]:
        return f"none beyond the calibration threshold ({sim})"
    return "DRIFTED: " + "; ".join(d["reasons"]) + " -- refit on this traffic (`eldr fit --from-decision-log`)"


def _tpot_text(section: dict) -> str:
    t = section.get("logged_tpot") or {}
    if "per_decoder" not in t:
        return t.get("note", "not available")
    per = "; ".join(f"d{x['decoder']} {x['logged_tpot_ms']:.2f} vs {x['predicted_tpot_ms']:.2f} ms "
                    f"({x['error_pct']:+.0f}%)" for x in t["per_decoder"])
    return f"mean |error| {t['mean_abs_error_pct']:.0f}% ({per}); {t['how']}"


def _at_load_text(a: dict) -> str:
    if "by_router" not in a:
        return a.get("note", "not available")
    parts = [f"{r} TPOT p50 {x['tpot_p50_ms']['mean']:.2f} ms" for r, x in a["by_router"].items()
             if x["tpot_p50_ms"]["mean"] is not None]
    ch = [f"{r} {c['mean']:+.1f}% [{c['ci95'][0]}, {c['ci95'][1]}]" for r, c in
          a["tpot_p50_change_vs_best_lb_pct"].items() if c["mean"] is not None]
    return "; ".join(parts) + (" -- TPOT p50 vs the best load balancer: " + ", ".join(ch) if ch else "")
