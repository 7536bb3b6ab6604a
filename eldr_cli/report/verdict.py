"""The verdict of `eldr report` from a capacity study (capacity_study.run_study): the dict written under
report.json's ``verdict`` key, its sentence, and the TPOT-vs-load figure. Everything here is SIMULATED."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli.costmodel.deployment import DEPLOYMENT_KEYS
from eldr_cli.report.capacity import CI_METHOD, CLAIRVOYANT, LIMITS, ORACLE, SLO, TOLERANCE, is_candidate
from eldr_cli.report.study import Study
from eldr_cli.routing import LOAD_BALANCERS
from eldr_cli.stats import Interval, interval_json, mean_ci, paired_pct_ci

LEGACY_LOAD_PCT = 75  # today's four verdict keys are computed at this load point
BY_LOAD_KEYS = ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms")


def fmt_change(x: Interval | None, what: str = "") -> str:
    """"-10.2% (95% CI -12.0 to -8.4%)", or "no measurable difference" when the interval spans 0."""
    if x is None:
        return "not measured"
    if x.lo is None or x.hi is None:
        return f"{x.mean:+.1f}%{what} (one seed: no interval)"
    if x.spans_zero:
        return "no measurable difference"
    return f"{x.mean:+.1f}%{what} (95% CI {x.lo:+.1f} to {x.hi:+.1f}%)"


def fmt_value(x: Interval | None, unit: str) -> str:
    """"58 ms [55-61]": the mean and its interval, rounded for reading."""
    if x is None:
        return "n/a"

    def r(v: float) -> str:
        return f"{v:.0f}" if abs(v) >= 100 else (f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}")

    ci = "" if x.lo is None or x.hi is None else f" [{r(x.lo)}-{r(x.hi)}]"
    return f"{r(x.mean)} {unit}{ci}"


def deployment_facts(cost) -> dict:
    """The instance a decoder is: the cost model's ``deployment`` when it states one, else what its roofline
    says (tp, ep, dtype); None for what neither states."""
    dep = dict(getattr(cost, "deployment", None) or {})
    roof = getattr(cost, "roofline", None)
    if roof is not None:
        for k in ("tp", "ep", "dtype"):
            dep.setdefault(k, getattr(roof, k, None))
    return {k: dep.get(k) for k in DEPLOYMENT_KEYS}


def capacity_gain(study: Study, router: str) -> tuple[Interval | None, Interval | None]:
    """(capacity gain vs the best load balancer in %, decode instances saved for the same traffic in %),
    both from the per-seed pairs; a seed where either capacity is 0 has no ratio and is left out. Each capacity
    is known within its search bracket [lo, (1 + TOLERANCE) lo), so the ratio of two is known within a factor
    (1 + TOLERANCE) either way: the t-interval is widened by that much (a 1% difference on the bisection's
    grid is not a measured 1%)."""
    c, b = study.rates(router), study.rates(study.best_lb)
    pairs = [(x, y) for x, y in zip(c, b, strict=True) if x > 0 and y > 0]
    gain = paired_pct_ci([x for x, _ in pairs], [y for _, y in pairs])
    saved = mean_ci([100.0 * (1.0 - y / x) for x, y in pairs])
    f = 1.0 + TOLERANCE
    if gain is not None and gain.lo is not None and gain.hi is not None:
        gain = Interval(gain.mean, 100.0 * ((1 + gain.lo / 100.0) / f - 1), 100.0 * ((1 + gain.hi / 100.0) * f - 1),
                        gain.n)
    if saved is not None and saved.lo is not None and saved.hi is not None:
        saved = Interval(saved.mean, 100.0 * (1 - (1 - saved.lo / 100.0) * f), 100.0 * (1 - (1 - saved.hi / 100.0) / f),
                         saved.n)
    return gain, saved


def change_at(study: Study, pct: int, router: str, key: str, base: str | None = None) -> Interval | None:
    return paired_pct_ci(study.seed_values(pct, router, key), study.seed_values(pct, base or study.best_lb,
                                                                              key))


def best_lb_at(study: Study, pct: int) -> dict | None:
    """The load balancer with the lowest mean median TPOT at one load point, and those it cannot be told
    from (their paired per-seed TPOT change against it spans 0): a "best" chosen among overlapping ones."""
    got = {r: mean_ci(study.seed_values(pct, r, "tpot_p50_ms")) for r in study.capacity if r in LOAD_BALANCERS}
    got = {r: m for r, m in got.items() if m is not None}
    if not got:
        return None
    best = min(got, key=lambda r: (got[r].mean, r))  # type: ignore[union-attr]
    ties = [r for r in got if r != best and (c := change_at(study, pct, r, "tpot_p50_ms", best)) is not None
            and c.spans_zero]
    return {"load_pct": pct, "router": best, "tpot_p50_ms": round(got[best].mean, 4),  # type: ignore[union-attr]
            "indistinguishable_from": ties}


def gain_difference(study: Study, a: str, b: str) -> Interval | None:
    """``a``'s capacity gain minus ``b``'s, both against the best load balancer, paired per seed, in
    percentage points (widened by the capacity search's tolerance as :func:`capacity_gain` is)."""
    if not {a, b} <= set(study.capacity):
        return None
    lb = study.rates(study.best_lb)
    diff = [100.0 * (x - y) / z for x, y, z in zip(study.rates(a), study.rates(b), lb, strict=True)
            if z > 0]
    iv = mean_ci(diff)
    if iv is None or iv.lo is None or iv.hi is None:
        return iv
    top = max(float(np.mean(study.rates(r))) for r in (a, b))
    tol = 100.0 * TOLERANCE * top / max(float(np.mean(lb)), 1e-9)
    return Interval(iv.mean, iv.lo - tol, iv.hi + tol, iv.n)


def build_verdict(study: Study, slo: SLO, seeds: list[int], deployment: dict) -> dict:
    """report.json's ``verdict`` (without its text): the keys tools read, then today's four at 75% load."""
    routers = list(study.capacity)
    best = study.best_lb
    v: dict = {"slo": {"tpot_p90_ms": slo.tpot_p90_ms, "ttft_p90_ms": slo.ttft_p90_ms},
               "best_load_balancer": best, "seeds": len(seeds), "status": study.status,
               "ci_method": CI_METHOD,
               "capacity_rps": {r: interval_json(mean_ci(study.rates(r))) for r in routers},
               "capacity_gain_vs_best_lb_pct": {}, "decode_instances_saved_pct": {},
               "binding_slo": {r: _binding(study, r) for r in routers},
               "by_load": [], "change_vs_best_lb_by_load": [], "deployment": deployment}
    loads = sorted({row.load_pct for row in study.by_load})
    v["best_lb_by_load"] = [b for pct in loads if (b := best_lb_at(study, pct)) is not None]
    at = {b["load_pct"]: b["router"] for b in v["best_lb_by_load"]}
    v["eldr_live_minus_eldr_capacity_pp"] = interval_json(gain_difference(study, "eldr-live", "eldr"), 2)
    v["clairvoyant_minus_eldr_live_capacity_pp"] = interval_json(gain_difference(study, CLAIRVOYANT, "eldr-live"), 2)
    v["best_load_balancer_indistinguishable_from"] = [
        r for r in routers if r in LOAD_BALANCERS and r != best
        and (c := paired_pct_ci(study.rates(r), study.rates(best))) is not None and c.spans_zero]
    for r in routers:
        if r in LOAD_BALANCERS:
            continue
        gain, saved = capacity_gain(study, r)
        v["capacity_gain_vs_best_lb_pct"][r] = interval_json(gain, 2)
        v["decode_instances_saved_pct"][r] = interval_json(saved, 2)
    for row in study.by_load:
        pct, r = row.load_pct, row.router
        v["by_load"].append({"load_pct": pct, "router": r, "rate_rps": round(row.rate_rps, 3),
                             **{k: interval_json(mean_ci([m.get(k) for m in row.seeds])) for k in BY_LOAD_KEYS}})
        base = at.get(pct, best)  # the load balancer with the lowest median TPOT at this load
        if r != base:
            v["change_vs_best_lb_by_load"].append(
                {"load_pct": pct, "router": r, "vs": base,
                 **{k.replace("_ms", "_pct"): interval_json(change_at(study, pct, r, k, base), 2)
                    for k in BY_LOAD_KEYS}})
    # today's four keys keep their meaning: the paper's eldr against the best load balancer
    v.update(legacy_keys(study, "eldr" if "eldr" in routers else headline_router(routers)))
    return v


def _binding(study: Study, router: str) -> str | None:
    """The SLO that failed first for most seeds ("tpot", "ttft"), None when none failed."""
    got = [c.binding for c in study.capacity[router] if c.binding]
    return max(set(got), key=got.count) if got else None


def headline_router(routers: list[str]) -> str | None:
    """The router the verdict is about: eldr-live (the proxy's default) when run, else eldr, else the first
    other candidate."""
    cands = [r for r in routers if is_candidate(r)]
    return next((r for r in ("eldr-live", "eldr") if r in cands), cands[0] if cands else None)


def legacy_keys(study: Study, router: str | None) -> dict:
    """Today's four verdict keys (and the TTFT one), now at 75% of the best load balancer's capacity."""
    from eldr_cli.routing.oracle import oracle_share

    out: dict = {"tpot_p50_change_vs_best_lb_pct": None, "tpot_p99_change_vs_best_lb_pct": None,
                 "ttft_p50_change_vs_best_lb_pct": None, "active_experts_change_vs_rr_pct": None,
                 "oracle_share_pct": None, "legacy_keys_load_pct": LEGACY_LOAD_PCT}
    if router is None or not study.by_load:
        return out
    pct, best = LEGACY_LOAD_PCT, study.best_lb
    for key, metric in (("tpot_p50_change_vs_best_lb_pct", "tpot_p50_ms"),
                        ("tpot_p99_change_vs_best_lb_pct", "tpot_p99_ms"),
                        ("ttft_p50_change_vs_best_lb_pct", "ttft_p50_ms")):
        iv = change_at(study, pct, router, metric)
        out[key] = None if iv is None else round(iv.mean, 2)
    rr = "round-robin" if "round-robin" in study.capacity else best
    iv = change_at(study, pct, router, "active_experts", rr)
    out["active_experts_change_vs_rr_pct"] = None if iv is None else round(iv.mean, 2)
    if ORACLE in study.capacity:
        m = {r: mean_ci(study.seed_values(pct, r, "tpot_p50_ms")) for r in (best, router, ORACLE)}
        if all(x is not None for x in m.values()):
            s = oracle_share(m[best].mean, m[router].mean, m[ORACLE].mean)  # type: ignore[union-attr]
            out["oracle_share_pct"] = None if s is None else round(float(np.clip(s, 0.0, 100.0)), 1)
    return out


def tpot_figure(path: Path, v: dict) -> Path | None:
    """TPOT p50 and p99 vs load (% of the best load balancer's capacity) per router, 95% bands."""
    rows = v["by_load"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    routers = list(dict.fromkeys(r["router"] for r in rows))
    for ax, key, title in zip(axes, ("tpot_p50_ms", "tpot_p99_ms"), ("TPOT p50", "TPOT p99"), strict=True):
        for r in routers:
            pts = sorted((x["load_pct"], x[key]) for x in rows if x["router"] == r and x[key]["mean"] is not None)
            if not pts:
                continue
            xs = [p for p, _ in pts]
            style = dict(lw=2.4) if is_candidate(r) else (dict(ls=":", lw=1.6) if r in LIMITS else dict(lw=1.2))
            ax.plot(xs, [m["mean"] for _, m in pts], marker="o", ms=3, label=r, **style)
            if all(m["ci95"][0] is not None for _, m in pts):
                ax.fill_between(xs, [m["ci95"][0] for _, m in pts], [m["ci95"][1] for _, m in pts], alpha=0.18)
        ax.axhline(v["slo"]["tpot_p90_ms"], color="grey", ls="--", lw=1, label="TPOT p90 target")
        ax.set_title(f"{title} (ms) vs load")
        ax.set_xlabel(f"load, % of {v['best_load_balancer']}'s capacity")
        ax.set_xticks(sorted({x["load_pct"] for x in rows}))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per output token")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"{v['seeds']} seeds; lines: means, bands: 95% intervals", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load_words(v: dict, router: str) -> str:
    """Where ``router``'s median TPOT is below (helps), above (hurts) or indistinguishable from the best LB's."""
    ch = [c for c in v["change_vs_best_lb_by_load"] if c["router"] == router]
    helps, hurts, same = [], [], []
    for c in ch:
        m, (lo, hi) = c["tpot_p50_pct"]["mean"], c["tpot_p50_pct"]["ci95"]
        if m is None:
            continue
        at = f"{c['load_pct']}%"
        vs = c.get("vs", v["best_load_balancer"])
        if lo is None or hi is None or lo <= 0 <= hi:
            same.append(at)
        elif hi < 0:
            helps.append(f"{at} (vs {vs}: {m:+.1f}%, {lo:+.1f} to {hi:+.1f})")
        else:
            hurts.append(f"{at} (vs {vs}: {m:+.1f}%, {lo:+.1f} to {hi:+.1f})")
    parts = []
    if helps:
        parts.append("it helps at " + ", ".join(helps))
    if hurts:
        parts.append("it hurts at " + ", ".join(hurts))
    if same:
        parts.append("no measurable difference at " + ", ".join(same))
    if not parts:
        return ""
    return (f" Median TPOT by load (% of {v['best_load_balancer']}'s capacity), paired against the load balancer "
            f"with the lowest median TPOT at that load ({_best_words(v)}): " + "; ".join(parts) + ".")


def _best_words(v: dict) -> str:
    """"10% jsq, 25% round-robin (indistinguishable from p2c)"."""
    out = []
    for b in v.get("best_lb_by_load", []):
        ties = b["indistinguishable_from"]
        out.append(f"{b['load_pct']}% {b['router']}" + (f" (indistinguishable from {', '.join(ties)})" if ties else ""))
    return ", ".join(out) or v["best_load_balancer"]


def verdict_text(v: dict, cost_label: str, n_prefill: int, n_decode: int, tried: tuple[float, float]) -> str:
    """The decision in words: capacity gain, instances saved, where the router helps and hurts, the oracle."""
    slo = v["slo"]
    head = (f"SIMULATED with {cost_label}, {n_prefill}P{n_decode}D, {v['seeds']} seeds (95% intervals). "
            f"SLO: TPOT p90 <= {slo['tpot_p90_ms']:g} ms and TTFT p90 <= {slo['ttft_p90_ms']:g} ms.")
    if v["status"] == "none":
        return (head + f" No router meets this SLO at any rate tried (down to {tried[0]:.3g} req/s): there is no "
                "capacity to compare. Loosen the SLO (--slo-tpot-ms, --slo-ttft-ms) or add decoders.")
    if v["status"] == "above":
        return (head + f" Every router meets this SLO at the highest rate tried ({tried[1]:.3g} req/s): the "
                "capacities are lower bounds and no gain can be measured. Tighten the SLO.")
    best = v["best_load_balancer"]
    cap = v["capacity_rps"][best]
    ties = v.get("best_load_balancer_indistinguishable_from") or []
    out = head + f" The best load balancer is {best}: {cap['mean']:.3g} req/s" + (
        f" (chosen among overlapping intervals: {', '.join(ties)} cannot be told from it)." if ties else ".")
    router = headline_router(list(v["capacity_rps"]))
    for r, g in v["capacity_gain_vs_best_lb_pct"].items():
        iv = Interval.from_json(g)
        name = LIMIT_NAMES.get(r, r)
        if iv is None:
            out += f" {name}: capacity gain not measurable."
        elif iv.lo is None or iv.hi is None:
            out += f" {name}: {iv.mean:+.1f}% capacity (one seed: no interval)."
        elif iv.spans_zero:
            out += f" {name}: no measurable difference in capacity ({iv.lo:+.1f} to {iv.hi:+.1f}%)."
        else:
            saved = Interval.from_json(v["decode_instances_saved_pct"][r])
            more = "more" if iv.mean >= 0 else "less"
            out += (f" {name} carries {abs(iv.mean):.1f}% {more} traffic at this SLO "
                    f"(95% CI {iv.lo:+.1f} to {iv.hi:+.1f}%)")
            if saved is not None and iv.mean > 0 and r not in LIMITS:
                out += f": the same traffic on {saved.mean:.0f}% fewer decode instances"
            out += "."
    out += _predictor_words(v)
    if router is not None:
        out += _load_words(v, router)
    ttft = [r for r, b in v["binding_slo"].items() if b == "ttft"]
    if ttft:
        out += (f" TTFT, not TPOT, is the binding SLO for {', '.join(ttft)}: prefill (or the TTFT target) limits "
                "that capacity, not the decoders; add prefill workers (--prefill) to compare decode routing.")
    return out


LIMIT_NAMES = {ORACLE: "The step-cluster oracle (balanced clusters of the served rows' decode steps, the band rule)",
               CLAIRVOYANT: "The clairvoyant router (eldr-live's rule on each request's true future decode "
                            "activations, the limit)"}


def _predictor_words(v: dict) -> str:
    """The distance from eldr-live to its clairvoyant twin: what a better predictor could still buy."""
    d = v.get("clairvoyant_minus_eldr_live_capacity_pp") or {}
    if d.get("mean") is None:
        return ""
    lo, hi = d["ci95"]
    ci = "one seed: no interval" if lo is None or hi is None else f"95% CI {lo:+.1f} to {hi:+.1f}"
    if lo is not None and hi is not None and lo <= 0 <= hi:
        return (" eldr-live and its clairvoyant twin (simulated, like every figure here) show no measurable "
                f"difference in capacity ({ci} points): a better predictor of decode activations would buy nothing "
                "measurable here.")
    return (" eldr-live's clairvoyant twin (simulated, like every figure here) carries "
            f"{d['mean']:+.1f} points of the best load balancer's capacity over eldr-live ({ci}): what a better "
            "predictor of decode activations could still buy.")
