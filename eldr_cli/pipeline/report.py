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
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

LOAD_BALANCERS = ("round-robin", "random", "jsq", "p2c")
DEFAULT_DEVICE = "H100-SXM"
STAGES = ("trace", "fit", "cost model", "simulate", "replay", "write")
REPLAY_BATCHES = (1, 4, 16, 64)


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return round(100.0 * (new - old) / old, 2)


def _mean(runs: list[dict], router: str, key: str) -> float | None:
    v = [r[key] for r in runs if r["router"] == router and r.get(key) is not None]
    return float(np.mean(v)) if v else None


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
    run_cost_model(out, pick, device=DEFAULT_DEVICE)
    return out, f"first-principles roofline, {how}, on {DEFAULT_DEVICE} (not measured)"


def saturation_rate(cost, n_layers: int, num_experts: int, top_k: int, n_decode: int, max_tokens: int,
                    batch: int = 64, prompt_tokens: float = 0.0) -> float:
    """Request rate at which ``n_decode`` workers run ``batch`` requests each (round-robin-like experts),
    each request half-way through its decode (a roofline charges that KV; a measured CPU model ignores it)."""
    active = min(num_experts, batch * max(top_k, 1)) * n_layers
    step_ms = cost.step_ms(active, n_layers, batch, context=[prompt_tokens + max_tokens / 2] * batch)
    return n_decode * batch * 1000.0 / (step_ms * max(max_tokens, 1))


def verdict(runs: list[dict]) -> dict:
    routers = list(dict.fromkeys(r["router"] for r in runs))
    lbs = [r for r in routers if r in LOAD_BALANCERS]
    if "eldr" not in routers or not lbs:
        raise EldrError("the verdict needs the eldr router and at least one load balancer")
    best = min(lbs, key=lambda r: _mean(runs, r, "median_tpot_ms") or float("inf"))
    e50, b50 = _mean(runs, "eldr", "median_tpot_ms"), _mean(runs, best, "median_tpot_ms")
    share = None
    if "oracle" in routers:
        o50 = _mean(runs, "oracle", "median_tpot_ms")
        if o50 is not None and b50 is not None and e50 is not None and b50 - o50 > 1e-9:
            share = round(float(np.clip(100.0 * (b50 - e50) / (b50 - o50), 0.0, 100.0)), 1)
    rr = "round-robin" if "round-robin" in routers else best
    return {
        "best_load_balancer": best,
        "tpot_p50_change_vs_best_lb_pct": _pct(e50, b50),
        "tpot_p99_change_vs_best_lb_pct": _pct(_mean(runs, "eldr", "p99_tpot_ms"), _mean(runs, best, "p99_tpot_ms")),
        "ttft_p50_change_vs_best_lb_pct": _pct(_mean(runs, "eldr", "median_ttft_ms"),
                                               _mean(runs, best, "median_ttft_ms")),
        "active_experts_change_vs_rr_pct": _pct(_mean(runs, "eldr", "mean_active_experts_per_step"),
                                                _mean(runs, rr, "mean_active_experts_per_step")),
        "oracle_share_pct": share,
    }


def verdict_text(v: dict, cost_label: str, n_prefill: int, n_decode: int) -> str:
    def f(x):
        return "n/a" if x is None else f"{abs(x):.1f}%"

    def verb(x, down="cut", up="raise"):
        return down if (x or 0) <= 0 else up

    p50, p99 = v["tpot_p50_change_vs_best_lb_pct"], v["tpot_p99_change_vs_best_lb_pct"]
    share = v["oracle_share_pct"]
    tail = (f", {share:.0f}% of the way from the best load balancer to the oracle" if share is not None
            else " (no oracle row in this run, so the share of the possible gain is not known)")
    return (f"SIMULATED with {cost_label}, {n_prefill}P{n_decode}D: on this trace ELDR is predicted to "
            f"{verb(p50)} median TPOT by {f(p50)} and {verb(p99)} p99 TPOT by {f(p99)} against the best load "
            f"balancer ({v['best_load_balancer']}){tail}; it changes the distinct experts a decode step activates "
            f"by {v['active_experts_change_vs_rr_pct'] if v['active_experts_change_vs_rr_pct'] is not None else 'n/a'}"
            f"% against round-robin (negative = fewer).")


def replay_text(res: dict) -> str:
    """One sentence on the replay's oracle row, at the batch size where the oracle is furthest below the best
    load balancer (relative), i.e. where the comparison says the most."""
    got = [s for s in res.get("oracle_share", []) if s.get("share_pct") is not None]
    if not got:
        return ""
    s = max(got, key=lambda s: ((s["best_lb_active"] - s["oracle_active"]) / max(s["best_lb_active"], 1e-9),
                                s["batch_size"]))
    head = (f" In trace replay (no cost model) at decode batch {s['batch_size']} ELDR activates "
            f"{s['eldr_active']:.1f} distinct experts per layer per step against {s['best_lb_active']:.1f} for the "
            f"best load balancer ({s['best_lb']}) and {s['oracle_active']:.1f} for the oracle: ")
    if s["share_pct"] > 100:
        return head + ("ELDR does better than this oracle, whose clusters come from the served rows' few decode "
                       "steps (ELDR's from all their prompt tokens).")
    return head + f"{max(s['share_pct'], 0.0):.0f}% of the way to the oracle."


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


def run_report(trace, out, *, fit=None, cost_model=None, rates=None, prefill=None, decode=None,
               routers=None, duration_s: float = 30.0, warmup_s: float = 5.0, max_tokens: int | None = None,
               split: str = "evaluation", seed: int = 0, progress=None) -> dict:
    """Write report.html/.md/.json into ``out``; return the verdict dict (keys as in report.json)."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.costmodel import CostModel
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.simulate import SIM_POLICIES, run_simulate

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
    R, L, E = tr.prefill_counts.shape
    top_k = int(tr.model.get("top_k") or 1)
    n_prefill = prefill or 2
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
        step("fit")
        notes = []
        if split_used != split:
            notes.append(f"the trace has no {split!r} split: served all its rows")
        if fit is None:
            fit = work / "fit"
            # 5,000 signature pairs (fit's default is 20,000) keep the report inside a minute on 2 cores
            run_fit(trace, fit, decoders=n_decode, seed=seed, pairs=5000,
                    split="calibration" if split_used == "evaluation" else "all")
            notes.append(f"fitted ELDR on the trace's calibration rows for {n_decode} decoders (5,000 pairs)")
        routing = Path(fit)
        step("cost model")
        if cost_model is None:
            cost_model, cost_label = default_cost_model(tr, work)
            notes.append(f"cost model: {cost_label}")
        else:
            from eldr_cli.artifacts.store import Artifact

            cp = Artifact(cost_model).params
            cost_label = f"{cp.get('source', 'measured')} cost model {Path(cost_model).name}" + (
                f" ({cp.get('model')} on {cp.get('device')})" if cp.get("model") else f" ({cp.get('device')})")
        cost = CostModel.load(cost_model)
        step("simulate")
        if rates is None:
            sat = saturation_rate(cost, L, E, top_k, n_decode, max_tokens,
                                  prompt_tokens=float(np.mean(tr.prompt_tokens)) if len(tr.prompt_tokens) else 0.0)
            rates = [round(sat * f, 3) for f in (0.25, 0.5, 0.75, 1.0)]
            notes.append(f"rates: 25-100% of the estimated decode saturation rate ({sat:.2f} req/s)")
        names = routers or [r for r in ("round-robin", "random", "jsq", "p2c", "eldr", "oracle") if r in SIM_POLICIES]
        sim = work / "simulate"
        run_simulate(sim, trace=trace, cost_model=cost_model, split=split_used, routers=names, rates=list(rates),
                     n_prefill=n_prefill, n_decode=n_decode, duration_s=duration_s, warmup_s=warmup_s,
                     max_tokens=max_tokens, routing=routing, seed=seed, title="SIMULATED")
        summary = json.loads((sim / "summary.json").read_text())
        runs = summary["runs"]
        step("replay")
        replay = _replay(trace, routing, names, split_used, seed, work / "replay")
        step("write")
        v = verdict(runs)
        text = verdict_text(v, cost_label, n_prefill, n_decode) + replay_text(replay)
        doc = {"verdict": {**v, "text": text}, "trace": {"path": str(trace), "model": tr.model.get("model"),
                                                         "requests": int(R), "n_layers": int(L),
                                                         "num_experts": int(E), "top_k": top_k,
                                                         "domains": _domains(tr)},
               "simulated": {"label": "SIMULATED", "cost_model": cost_label, "prefill": n_prefill,
                             "decode": n_decode, "rates": list(rates), "routers": names, "max_tokens": max_tokens,
                             "duration_s": duration_s, "split": split_used},
               "fit": _fit_facts(routing), "runs": runs, "oracle_share_by_rate": summary.get("oracle_share", []),
               "replay": replay, "notes": notes}
        stage = work / "report"
        stage.mkdir()
        figs = _figures(Path(trace), routing, sim, work / "replay")
        from eldr_cli.pipeline.report_render import render_html, render_md

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
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return doc["verdict"]


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

    try:
        m = Artifact(fit).metrics
    except Exception:  # noqa: BLE001 - a routing artifact (not a fit) carries fewer facts
        return {}
    return {k: m.get(k) for k in ("transform", "rho_by_transform", "n_layers_kept", "rho_peak", "cluster_sizes")}
