"""`eldr report`: what ELDR buys a deployment, predicted from one trace for one cost model.

Chains what is missing (fit, cost model) into a simulation sweep and writes one self-contained
``report.html`` (figures embedded as base64 PNG), ``report.md`` and ``report.json`` with the verdict.
Every predicted number comes from the discrete-event simulator and is labelled SIMULATED.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.report.study import ReportPlan, SimSetup
from eldr_cli.routing import LOAD_BALANCERS
from eldr_cli.routing.registry import check_policy

DEFAULT_DEVICE = "H100-SXM"
DEFAULT_DTYPES = ("bf16", "fp8")
STAGES = ("trace", "fit", "cost model", "simulate", "replay", "write")
REPLAY_BATCHES = (1, 4, 16, 64)


def default_cost_model(tr, work: Path) -> tuple[Path, str]:
    """A roofline for the trace's model: its name when that is a preset, else the preset with the same
    (L, E, top-k) shape. Anything else needs --cost-model (we will not guess a model's weights)."""
    from eldr_cli.costmodel.presets import MODELS
    from eldr_cli.costmodel.roofline import model_facts, run_cost_model

    name = str(tr.model.get("model") or "")
    _, L, E = tr.prefill_counts.shape
    k = tr.model.get("top_k")
    pick = next((m for m in MODELS if m.lower() in name.lower()), None)
    how = f"preset {pick} named by the trace"
    if pick is None:
        for m, cfg in MODELS.items():
            f = model_facts(cfg)
            if (f.moe_layers, f.num_experts) == (L, E) and (k is None or f.top_k == k):
                pick, how = m, f"preset {m}, the one of the trace's shape (L={L}, E={E}, top-{k})"
                break
    if pick is None:
        raise EldrError(f"no cost model given and no preset model has the trace's shape (L={L}, E={E}, top-{k})",
                        hint="write one: eldr bench cost-model --model CONFIG.json --device H100-SXM --out CM, "
                             "then pass --cost-model CM")
    out = work / "cost-model"
    for dtype in DEFAULT_DTYPES:  # bf16 when some TP holds it, else fp8 (Llama-4-Maverick on H100s)
        try:
            run_cost_model(out, pick, device=DEFAULT_DEVICE, dtype=dtype)
            break
        except EldrError as e:
            refused = e
    else:
        raise refused
    return out, f"first-principles roofline, {how}, {dtype}, on {DEFAULT_DEVICE}: {cost_provenance(out)}"


def cost_provenance(cost_model) -> str:
    """One sentence: MEASURED (on which device) or the roofline and its calibration (or that it has none)."""
    from eldr_cli.artifacts.store import Artifact

    p = Artifact(cost_model).params
    if p.get("source") == "measured-decode-step":
        how = "torch.compile + CUDA graph" if p.get("compiled") else (
            "CUDA graph" if p.get("launch") == "graph" or p.get("measured") else "launched eagerly")
        shipped = " (shipped with eldr)" if p.get("measured") else ""
        return (f"MEASURED decode step: one {p.get('model')} TP{p.get('tp', 1)} decoder layer ({how}) on "
                f"{p.get('device', 'cpu')}{shipped}")
    if p.get("source") != "roofline":
        return f"MEASURED cost model ({p.get('source', 'measured')}) on {p.get('device', 'cpu')}"
    cal = p.get("calibration") or {}
    return cal.get("provenance") or "roofline NOT calibrated on a measurement (written before calibrations)"


def replay_text(res: dict) -> str:
    """One sentence on the replay's step-cluster oracle and clairvoyant rows, at the batch size where the oracle is
    furthest below the best load balancer (relative), i.e. where the comparison says the most."""
    got = [s for s in res.get("oracle_share", []) if s.get("share_pct") is not None]
    if not got:
        return ""
    s = max(got, key=lambda s: ((s["best_lb_active"] - s["oracle_active"]) / max(s["best_lb_active"], 1e-9),
                                s["batch_size"]))
    head = (f" In trace replay (no cost model) at decode batch {s['batch_size']} ELDR activates "
            f"{s['eldr_active']:.1f} distinct experts per layer per step against {s['best_lb_active']:.1f} for the "
            f"best load balancer ({s['best_lb']}) and {s['oracle_active']:.1f} for the step-cluster oracle: ")
    if s.get("clairvoyant_active") is not None:
        head = head[:-2] + (f", {s['clairvoyant_active']:.1f} for eldr-live's clairvoyant twin (the limit of "
                            "eldr-live's rule, which trades locality for load and step cost): ")
    if s["share_pct"] > 100:
        return head + ("ELDR does better than the step-cluster oracle, whose clusters come from the served rows' "
                       "few decode steps (ELDR's from all their prompt tokens).")
    return head + f"{max(s['share_pct'], 0.0):.0f}% of the way to the step-cluster oracle."


def _figures(*dirs: Path | None) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if d is not None and Path(d).is_dir():
            out += sorted(Path(d).rglob("*.png"))
    return out


def _fit_decoders(fit) -> int:
    """K (decode workers) of a fit or routing artifact."""
    from eldr_cli.routing import RoutingModel

    return int(RoutingModel.load(fit).n_clusters)


def _cost_label(cost_model) -> str:
    from eldr_cli.artifacts.store import Artifact

    cp = Artifact(cost_model).params
    return f"{cp.get('source', 'measured')} cost model {Path(cost_model).name}" + (
        f" ({cp.get('model')} on {cp.get('device')})" if cp.get("model") else f" ({cp.get('device')})")


def run_report(trace, out, *, fit=None, cost_model=None, prefill=None, decode=None, routers=None,
               seeds: int = 5, slo_tpot_ms: float | None = None, slo_ttft_ms: float | None = None,
               duration_s: float = 0.0, max_tokens: int | None = None, split: str = "evaluation",
               seed: int = 0, progress=None) -> dict:
    """Write report.html/.md/.json into ``out``; return the verdict dict (keys as in report.json)."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.costmodel import CostModel
    from eldr_cli.report.capacity import check_slo_values

    check_slo_values(slo_tpot_ms, slo_ttft_ms, seeds)
    step = progress or (lambda name: None)
    out = Path(out)
    check_output(out, "report", [p for p in (trace, fit, cost_model) if p])
    t0 = time.perf_counter()
    step("trace")
    tr = read_trace(trace)
    if tr.decode_picks is None or tr.decode_offsets is None:
        raise EldrError(f"trace {trace} has no per-step decode picks, which the report's simulation needs",
                        hint="capture again (`eldr capture --model M --prompts P --max-new-tokens N` records "
                             "per-step picks) or generate with `eldr synth-trace --picks`")
    names = _routers(routers)
    n_decode = decode or (_fit_decoders(fit) if fit is not None else 4)  # a given fit fixes K
    steps = np.diff(np.asarray(tr.decode_offsets, dtype=np.int64))
    max_tokens = max_tokens or max(int(np.median(steps)), 1)
    split_used = split
    try:
        tr.split_mask(split)
    except EldrError:
        split_used = "all"
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.resolve().parent))
    try:
        notes: list[str] = []
        if split_used != split:
            notes.append(f"the trace has no {split!r} split: served all its rows")
        step("fit")
        routing = _ensure_fit(trace, fit, work, n_decode, seed, split_used, notes)
        step("cost model")
        if cost_model is None:
            cost_model, cost_label = default_cost_model(tr, work)
            notes.append(f"cost model: {cost_label}")
        else:
            cost_label = _cost_label(cost_model)
        plan = ReportPlan(trace, tr, routing, Path(cost_model), CostModel.load(cost_model), split_used,
                          n_decode, max_tokens, duration_s, tuple(seed + i for i in range(seeds)), slo_tpot_ms,
                          slo_ttft_ms, prefill)
        doc = _simulate_and_judge(plan, cost_label, names, bool(routers), notes, work, step)
        step("replay")
        doc["replay"] = _replay(trace, routing, doc["simulated"]["routers"], split_used, seed, work / "replay")
        doc["verdict"]["text"] += replay_text(doc["replay"])
        step("write")
        _write(doc, out, work, trace, routing, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return doc["verdict"]


def _routers(routers) -> list[str]:
    """The routers to compare: the given ones, else every simulator router but domain (which needs domain
    labels), so a router added to the simulator joins the report as a candidate."""
    from eldr_cli.pipeline.simulate import SIM_POLICIES

    names = list(routers) if routers else [r for r in SIM_POLICIES if r != "domain"]
    for r in names:
        check_policy(r)
    if not any(r in LOAD_BALANCERS for r in names):
        raise EldrError("the report compares against the best load balancer: give at least one of "
                        + ", ".join(LOAD_BALANCERS))
    return list(dict.fromkeys(names))


def _ensure_fit(trace, fit, work: Path, n_decode: int, seed: int, split: str, notes: list[str]) -> Path:
    from eldr_cli.pipeline.fit import run_fit

    if fit is not None:
        return Path(fit)
    # 5,000 signature pairs (fit's default is 20,000) keep the report inside a minute on 2 cores
    run_fit(trace, work / "fit", decoders=n_decode, seed=seed, pairs=5000,
            split="calibration" if split == "evaluation" else "all")
    notes.append(f"fitted ELDR on the trace's calibration rows for {n_decode} decoders (5,000 pairs)")
    return work / "fit"


def _buildable(names: list[str], setup: SimSetup, notes: list[str]) -> list[str]:
    """The default routers this routing artifact and cost model can build (an artifact fitted before a policy
    existed lacks its parts: that router is left out and the notes say why)."""
    from eldr_cli.routing import make_router

    keep = []
    for r in names:
        try:
            make_router(r, setup.n_decode, model=setup.model, oracle=setup.oracle, cost=setup.replay.cost)
            keep.append(r)
        except EldrError as e:
            notes.append(f"router {r} left out: {str(e).splitlines()[0]}")
    return keep


def _simulate_and_judge(plan: ReportPlan, cost_label: str, names: list[str], routers_given: bool, notes: list[str],
                        work: Path, step) -> dict:
    """The capacity study and its verdict: the report document without replay and figures."""
    from eldr_cli.report.sensitivity import sensitivity, sensitivity_text
    from eldr_cli.report.study import build_setup, run_sized_study
    from eldr_cli.report.verdict import build_verdict, deployment_facts, headline_router, tpot_figure, verdict_text

    setup, slo, bound, prefill_ms = build_setup(plan, notes)
    if slo.how != "given":
        notes.append(f"SLO: {slo.how}")
    if not routers_given:
        names = _buildable(names, setup, notes)
    step("simulate")
    seed_list = list(plan.seeds)
    start = bound / 2.0
    study, setup = run_sized_study(setup, names, seed_list, slo, start, prefill_ms if plan.prefill is None else None,
                                   notes)
    v = build_verdict(study, slo, seed_list, deployment_facts(plan.cost))
    tried = (start / 2 ** 10, start * 2 ** 5)
    v["text"] = verdict_text(v, cost_label, setup.n_prefill, plan.n_decode, tried)
    rows = sensitivity(setup, study, slo, seed_list, start, headline_router(names))
    v["cost_model"] = {"provenance": cost_provenance(plan.cost_model), "sensitivity": rows}
    v["text"] += sensitivity_text(rows)
    (work / "capacity").mkdir()
    tpot_figure(work / "capacity" / "tpot_vs_load.png", v)
    return {"verdict": v, "trace": _trace_facts(plan),
            "simulated": {"label": "SIMULATED", "cost_model": cost_label, "prefill": setup.n_prefill,
                          "decode": plan.n_decode, "routers": names, "max_tokens": plan.max_tokens,
                          "split": plan.split, "seeds": seed_list, "slo_how": slo.how,
                          "warmup_s": round(setup.warmup_s, 2), "min_window_s": round(setup.duration_s, 2),
                          "start_rps": round(start, 4), "runs": study.runs, "simulate_s": round(study.sim_s, 2),
                          "rates_tried_rps": [round(x, 4) for x in tried]},
            "capacity": {r: [{"seed": s, "rate_rps": round(c.rate, 4), "status": c.status, "binding": c.binding,
                              "bracket_rps": [c.lo, c.hi], "probes": len(c.probes)}
                             for s, c in zip(seed_list, cs, strict=True)]
                         for r, cs in study.capacity.items()},
            "by_load_runs": [asdict(row) for row in study.by_load], "fit": _fit_facts(plan.routing), "notes": notes}


def _trace_facts(plan: ReportPlan) -> dict:
    tr = plan.tr
    R, L, E = tr.prefill_counts.shape
    return {"path": str(plan.trace), "model": tr.model.get("model"), "requests": int(R), "n_layers": int(L),
            "num_experts": int(E), "top_k": int(tr.model.get("top_k") or 1), "domains": _domains(tr)}


def _write(doc: dict, out: Path, work: Path, trace, routing: Path, t0: float) -> None:
    from eldr_cli.report.render import render_html, render_md

    stage = work / "report"
    stage.mkdir()
    figs = _figures(work / "capacity", Path(trace), routing, work / "replay")
    doc["figures"] = [f.name for f in figs]
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    (stage / "report.json").write_text(json.dumps(doc, indent=2, default=str))
    (stage / "report.md").write_text(render_md(doc))
    (stage / "report.html").write_text(render_html(doc, {f.name: base64.b64encode(f.read_bytes()).decode()
                                                         for f in figs}))
    (stage / "manifest.json").write_text(json.dumps({"tool": "eldr", "kind": "report",
                                                     "inputs": {"trace": str(trace)}}))
    if out.exists():
        shutil.rmtree(out)
    stage.rename(out)


def _replay(trace, routing, routers: list[str], split: str, seed: int, fig_dir: Path) -> dict:
    """Fig. 13 from the trace itself: distinct active experts per decode step by policy and batch size,
    replayed closed-loop with the oracle row and ELDR's share of the best-balancer-to-oracle distance."""
    from eldr_cli.pipeline.replay import REPLAY_POLICIES, replay_figure, run_replay

    res = run_replay(trace, routing=routing, policies=[r for r in routers if r in REPLAY_POLICIES],
                     batch_sizes=REPLAY_BATCHES, split=split, seed=seed)
    fig_dir.mkdir(parents=True, exist_ok=True)
    replay_figure(fig_dir / "fig13_replay.png", res)
    return res


def _domains(tr) -> dict:
    if "domain" not in tr.requests.columns:
        return {}
    vals, counts = np.unique(np.asarray(tr.column("domain"), dtype=str), return_counts=True)
    return {str(v): int(c) for v, c in zip(vals, counts, strict=True)}


def _fit_facts(fit: Path) -> dict:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.routing.model import load_routing_artifact

    try:
        m = Artifact(fit).metrics
    except Exception:  # noqa: BLE001 - a routing artifact (not a fit) carries fewer facts
        return {}
    facts = {k: m.get(k) for k in ("transform", "rho_by_transform", "n_layers_kept", "rho_peak", "cluster_sizes")}
    try:  # eldr-live's band prior, as the fit decided it (routing.live.band_prior_weight)
        p = load_routing_artifact(fit).params
    except Exception:  # noqa: BLE001 - the facts above stand without it
        return facts
    facts["band_prior"] = None if p.get("band_prior") is None else float(p["band_prior"])
    facts["centroid_cosine"] = ((p.get("drift") or {}).get("centroid") or {}).get("mean")
    return facts
