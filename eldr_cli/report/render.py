"""Render the report document (the dict written to report.json) as Markdown and as one self-contained HTML.

Both are built from the same list of sections (:func:`sections`): the decision, the headline, the
TPOT-vs-load figure, then the evidence. Numbers are rounded with units; "SIMULATED" is said once per
section that holds simulated numbers.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from eldr_cli.costmodel.deployment import DEPLOYMENT_KEYS
from eldr_cli.report.verdict import fmt_change, fmt_value
from eldr_cli.routing import LOAD_BALANCERS
from eldr_cli.stats import Interval

EVIDENCE = [("Signature quality: rho per transform, greedy layer curve, N*", ("fig7", "fig8")),
            ("Clusters", ("fig9",)),
            ("The trace", ("fig1", "fig3"))]


@dataclass
class Section:
    title: str
    label: str = ""                                  # "SIMULATED", "REPLAY", ... said once, in the heading
    paragraphs: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)  # (id, head, rows)
    figures: list[str] = field(default_factory=list)


_iv = Interval.from_json  # a report.json {"mean", "ci95"} pair as an Interval (None without a mean)


def _num(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def headline(doc: dict) -> list[tuple[str, str, str]]:
    """The headline card: (label, big figure, small print) for capacity gain, decode instances saved, TPOT
    p50 and p99 change at 75% load. Figures are "no measurable difference" when the interval spans 0."""
    from eldr_cli.report.verdict import LEGACY_LOAD_PCT, headline_router

    v = doc["verdict"]
    r = headline_router(list(v["capacity_rps"]))
    best = v["best_load_balancer"]
    if r is None or v["status"] != "ok":
        return []

    def tile(label: str, iv: Interval | None) -> tuple[str, str, str]:
        text = fmt_change(iv)
        big, _, small = text.partition(" (")
        return label, big, small.rstrip(")")

    at = {c["router"]: c for c in v["change_vs_best_lb_by_load"] if c["load_pct"] == LEGACY_LOAD_PCT}.get(r, {})
    saved = _iv(v["decode_instances_saved_pct"].get(r))
    return [tile(f"{r} capacity at SLO vs {best}", _iv(v["capacity_gain_vs_best_lb_pct"].get(r))),
            tile("decode instances for the same traffic",
                 None if saved is None else Interval(-saved.mean, None if saved.hi is None else -saved.hi,
                                                     None if saved.lo is None else -saved.lo, 0)),
            vs(tile(f"TPOT p50 at {LEGACY_LOAD_PCT}% load", _iv(at.get("tpot_p50_pct"))), at),
            vs(tile(f"TPOT p99 at {LEGACY_LOAD_PCT}% load", _iv(at.get("tpot_p99_pct"))), at)]


def vs(t: tuple[str, str, str], at: dict) -> tuple[str, str, str]:
    """A TPOT tile's small print names the load balancer it is paired against (the lowest TPOT there)."""
    return t[0], t[1], "; ".join(x for x in (t[2], f"vs {at['vs']}" if at.get("vs") else "") if x)


def decision(doc: dict) -> str:
    """One word on what to do, ahead of the verdict's paragraph."""
    from eldr_cli.report.verdict import headline_router

    v = doc["verdict"]
    r = headline_router(list(v["capacity_rps"]))
    if v["status"] == "none":
        return "No decision: no router meets this SLO at any rate tried."
    if v["status"] == "above":
        return "No decision: every router meets this SLO at the highest rate tried."
    if r is None:
        return "No decision: no router other than load balancers and the limit rows was compared."
    g = _iv(v["capacity_gain_vs_best_lb_pct"].get(r))
    if g is None or g.lo is None or g.hi is None:
        return "No decision: capacity gain not measurable."
    if g.spans_zero:
        return f"No measurable capacity difference between {r} and {v['best_load_balancer']} at this SLO."
    out = (f"Deploy {r}: more capacity at this SLO." if g.mean > 0 else
           f"Do not deploy {r} for this workload and SLO: it carries less traffic than {v['best_load_balancer']}.")
    return out + _live_vs_eldr(v, r)


def _live_vs_eldr(v: dict, r: str) -> str:
    """Why the headline router and not eldr: their paired capacity difference, and the reason."""
    d = _iv(v.get("eldr_live_minus_eldr_capacity_pp") or {"mean": None, "ci95": [None, None]})
    if r != "eldr-live" or d is None or d.lo is None or d.hi is None:
        return ""
    diff = f"eldr-live minus eldr: {d.mean:+.1f} capacity points (95% CI {d.lo:+.1f} to {d.hi:+.1f}, paired)"
    if d.spans_zero:
        return (f" {diff}: no measurable difference, so eldr-live, serve-proxy's default (it predicts each request's "
                "experts as it runs instead of holding a fixed placement), is the one named.")
    if d.mean > 0:
        return f" {diff}: eldr-live carries measurably more than eldr."
    return (f" {diff}: eldr carries measurably more here; eldr-live is named as serve-proxy's default, and "
            "`--policy eldr` is the better choice for this workload.")


def capacity_table(v: dict) -> tuple[str, list[str], list[list[str]]]:
    """Per router: capacity (req/s) [95% interval], the paired change vs the best load balancer, the SLO that
    failed first above it. Fits 80 columns in a terminal."""
    head = ["router", "capacity req/s", "vs best LB, %", "binding"]
    rows = []
    for r, c in v["capacity_rps"].items():
        kind = " (LB)" if r in LOAD_BALANCERS else {"clairvoyant": " (limit)", "oracle": " (step clusters)"}.get(r, "")
        g = _iv(v["capacity_gain_vs_best_lb_pct"].get(r))
        if r == v["best_load_balancer"]:
            vs = "best LB"
        elif g is None:
            vs = "-"
        elif g.lo is None or g.hi is None:
            vs = f"{g.mean:+.1f} (one seed)"
        else:
            vs = "no measurable difference" if g.spans_zero else f"{g.mean:+.1f} [{g.lo:+.1f}, {g.hi:+.1f}]"
        rows.append([r + kind, fmt_value(_iv(c), "").replace("  [", " ["), vs,
                     (v["binding_slo"].get(r) or "-").upper()])
    return "capacity", head, rows


def _load_tables(v: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    head = ["router", "TPOT p50", "TPOT p99", "TTFT p50", "TPOT p50 vs best LB"]
    change = {(c["load_pct"], c["router"]): c for c in v["change_vs_best_lb_by_load"]}
    out = []
    for pct in sorted({r["load_pct"] for r in v["by_load"]}):
        rows = []
        for r in [x for x in v["by_load"] if x["load_pct"] == pct]:
            c = change.get((pct, r["router"]))
            rows.append([r["router"], fmt_value(_iv(r["tpot_p50_ms"]), "ms"), fmt_value(_iv(r["tpot_p99_ms"]), "ms"),
                         fmt_value(_iv(r["ttft_p50_ms"]), "ms"),
                         "best LB" if c is None else fmt_change(_iv(c["tpot_p50_pct"]))])
        rate = next(x["rate_rps"] for x in v["by_load"] if x["load_pct"] == pct)
        out.append((f"load-{pct}", [f"{pct}% load ({rate:.3g} req/s)", *head[1:]], rows))
    return out


def _facts(doc: dict) -> list[list[str]]:
    t, s, v = doc["trace"], doc["simulated"], doc["verdict"]
    dep = v.get("deployment") or {}
    ds = ", ".join(f"{k.replace('_', ' ')}: {'not stated' if dep.get(k) is None else dep[k]}"
                   for k in DEPLOYMENT_KEYS)
    return [["model", str(t["model"])],
            ["trace", f"{t['requests']} requests, {t['n_layers']} MoE layers x {t['num_experts']} experts, "
                      f"top-{t['top_k']}; served: {s['split']} rows"],
            ["domains", ", ".join(f"{k}: {n}" for k, n in t["domains"].items()) or "unlabelled"],
            ["cost model", s["cost_model"]],
            ["cost model provenance", (v.get("cost_model") or {}).get("provenance", "not stated")],
            ["decode instance", ds],
            ["topology", f"{s['prefill']} prefill, {s['decode']} decode workers; {s['max_tokens']} output tokens "
                         "per request"],
            ["SLO", f"TPOT p90 <= {v['slo']['tpot_p90_ms']:g} ms, TTFT p90 <= {v['slo']['ttft_p90_ms']:g} ms"
                    + ("" if s["slo_how"] == "given" else f" ({s['slo_how']})")],
            ["seeds", f"{len(s['seeds'])} ({v['ci_method']})"],
            ["capacity search", f"double/halve from {s['start_rps']:.3g} req/s, then bisect until the bracket "
                                "is within 2%; the capacity is its lower end (error < 2%)"],
            ["runs", f"{s['runs']} simulated runs, {s['simulate_s']:.0f} s; warm-up {s['warmup_s']:.0f} s, "
                     f"measured window {s['min_window_s']:.3g} s, but 300 to 2,000 requests"]]


def _sensitivity_table(v: dict) -> tuple[str, list[str], list[list[str]]]:
    rows = (v.get("cost_model") or {}).get("sensitivity") or []
    return ("sensitivity", ["per-expert cost", "fixed cost", "router", "capacity vs best LB, %"],
            [[f"x{r['per_expert_scale']:g}", f"x{r['fixed_scale']:g}", f"{r['router']} vs {r['vs']}",
              fmt_change(_iv(r["capacity_gain_pct"]))] for r in rows])


def _fit_text(doc: dict) -> str:
    f = doc.get("fit") or {}
    rho = f.get("rho_by_transform") or {}
    sizes = f.get("cluster_sizes") or []
    parts = []
    if f.get("transform"):
        parts.append(f"signature transform: {f['transform']}")
    if rho:
        parts.append("rho per transform: " + ", ".join(f"{k} {float(x):.3f}" for k, x in rho.items()))
    if f.get("n_layers_kept") is not None:
        parts.append(f"layers kept N* = {f['n_layers_kept']}"
                     + (f" (rho {float(f['rho_peak']):.3f})" if f.get("rho_peak") is not None else ""))
    if sizes:
        parts.append(f"cluster sizes {min(sizes)}-{max(sizes)} over {len(sizes)} clusters")
    if f.get("band_prior") is not None and f.get("centroid_cosine") is not None:
        parts.append(f"eldr-live band prior {float(f['band_prior']):g} under load (calibration requests' mean "
                     f"cosine to their centroid {float(f['centroid_cosine']):.3f})")
    elif "band_prior" in f:
        parts.append("eldr-live band prior: none (fitted before it; `eldr fit` decides it)")
    return "; ".join(parts) + "." if parts else ""


def _load_intro(v: dict) -> str:
    if not v["by_load"]:
        return ("No load points: " + ("no router has a capacity at this SLO." if v["status"] == "none" else
                                      "the capacities are lower bounds (every router met the SLO at the highest "
                                      "rate tried)."))
    return (f"Every router at 10, 25, 50, 75 and 100% of {v['best_load_balancer']}'s capacity; lines are means over "
            "seeds, bands their 95% intervals.")


def sections(doc: dict) -> list[Section]:
    from eldr_cli.pipeline.replay import replay_rows

    v, figs = doc["verdict"], list(doc["figures"])
    out = [Section("Decision", "", [decision(doc), v["text"]]),  # the text says SIMULATED itself
           Section("TPOT vs load", "SIMULATED", [_load_intro(v)],
                   figures=[f for f in figs if f.startswith("tpot_vs_load")]),
           Section("Capacity at SLO", "SIMULATED", tables=[capacity_table(v)]),
           Section("Load regimes", "SIMULATED", ["Mean [95% interval] over seeds; changes are paired per seed."],
                   tables=_load_tables(v)),
           Section("How much the verdict rests on the cost model", "SIMULATED",
                   ["The GPU's per-expert and fixed costs moved by 25% while the router keeps the model's."],
                   tables=[_sensitivity_table(v)]),
           Section("Deployment and method", "", tables=[("facts", ["", ""], _facts(doc))])]
    if doc.get("replay") and doc["replay"].get("results"):
        res = doc["replay"]
        out.append(Section("Distinct active experts per decode step", "REPLAY",
                           [f"Closed-loop trace replay, no cost model ({res['trace_source']} trace, "
                            f"K={res['n_decoders']} decoders, {res['served_rows']} {res['split']} rows): experts "
                            "per layer per step by policy and batch size."],
                           tables=[("replay", *replay_rows(res))], figures=[f for f in figs if f.startswith("fig13")]))
    used = {f for s in out for f in s.figures}
    for title, keys in EVIDENCE:
        got = [f for f in figs if any(f.lower().startswith(k + "_") for k in keys) and f not in used]
        used.update(got)
        text = [_fit_text(doc)] if title.startswith("Signature") and _fit_text(doc) else []
        out.append(Section(title, "", text or ([] if got else ["(no figure: the input artifact has none)"]),
                           figures=got))
    rest = [f for f in figs if f not in used]
    if rest:
        out.append(Section("Other figures", figures=rest))
    if doc["notes"]:
        out.append(Section("Notes", paragraphs=list(doc["notes"])))
    return out


def render_md(doc: dict) -> str:
    lines = [f"# eldr report: {doc['trace']['model']}", ""]
    for s in sections(doc):
        lines += [f"## {s.title}" + (f" -- {s.label}" if s.label else ""), ""]
        if s.title == "Decision":
            lines += [f"**{s.paragraphs[0]}** {s.paragraphs[1]}", ""]
            lines += [f"- {a}: **{b}**" + (f" ({c})" if c else "") for a, b, c in headline(doc)] + [""]
        else:
            lines += [p + "\n" for p in s.paragraphs]
        for tid, head, rows in s.tables:
            if tid == "facts":
                lines += ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows] + [""]
                continue
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
        lines += [f"- {f} (embedded in report.html)" for f in s.figures] + ([""] if s.figures else [])
    return "\n".join(lines).rstrip() + "\n"


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1080px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.45}h1{font-size:1.6em;margin-bottom:.2em}
h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.sim{font-size:.7em;color:#a33;font-weight:600;letter-spacing:.05em;margin-left:.6em;vertical-align:middle}
.decision{font-size:1.15em;font-weight:600}.card{display:flex;gap:12px;flex-wrap:wrap;margin:1em 0}
.tile{flex:1 1 200px;border:1px solid #cfd8e3;border-radius:8px;padding:.8em 1em;background:#f6f9fc}
.tile .label{font-size:.85em;color:#555}.tile .big{font-size:1.7em;font-weight:700;margin:.15em 0}
.tile .small{font-size:.8em;color:#555}table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.92em}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}th{background:#f3f3f3}
td:not(:first-child){font-variant-numeric:tabular-nums}img{max-width:100%}figure{margin:1em 0}
figcaption{font-size:.8em;color:#777}"""


def _html_table(tid: str, head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    th = "" if not any(head) else "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table id='{e(tid)}'>{th}{body}</table>"


def render_html(doc: dict, images: dict[str, str]) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>eldr report</title>",
             f"<style>{CSS}</style></head><body><h1>eldr report: {e(str(doc['trace']['model']))}</h1>"]
    for s in sections(doc):
        label = f"<span class='sim'>{e(s.label)}</span>" if s.label else ""
        parts.append(f"<section><h2>{e(s.title)}{label}</h2>")
        if s.title == "Decision":
            parts.append(f"<p class='decision'>{e(s.paragraphs[0])}</p><p id='verdict-text'>{e(s.paragraphs[1])}"
                         "</p><div class='card' id='headline'>")
            parts += [f"<div class='tile'><div class='label'>{e(a)}</div><div class='big'>{e(b)}</div>"
                      f"<div class='small'>{e(c)}</div></div>" for a, b, c in headline(doc)]
            parts.append("</div>")
        else:
            parts += [f"<p>{e(p)}</p>" for p in s.paragraphs]
        parts += [_html_table(*t) for t in s.tables]
        parts += [f"<figure><img alt='{e(f)}' src='data:image/png;base64,{images[f]}'><figcaption>{e(f)}"
                  "</figcaption></figure>" for f in s.figures if f in images]
        parts.append("</section>")
    return "\n".join(parts) + "</body></html>\n"

