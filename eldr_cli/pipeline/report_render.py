"""Render the report document (the dict written to report.json) as Markdown and as one self-contained HTML."""

from __future__ import annotations

import html

SECTIONS = [
    ("The trace", ("fig1", "fig3")),
    ("Signature quality (rho per transform, greedy layer curve, N*)", ("fig7", "fig8")),
    ("Clusters", ("fig9",)),
    ("Distinct active experts per decode step by policy and batch size -- trace REPLAY and SIMULATED",
     ("fig13",)),
    ("Predicted TPOT p50/p99 and TTFT vs request rate per router -- SIMULATED", ("fig11",)),
]
VERDICT_KEYS = ("tpot_p50_change_vs_best_lb_pct", "tpot_p99_change_vs_best_lb_pct",
                "active_experts_change_vs_rr_pct", "oracle_share_pct")


def _fmt(x) -> str:
    return "n/a" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def _table(doc: dict) -> tuple[list[str], list[list[str]]]:
    head = ["router", "rate", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "active experts/step/layer"]
    rows = [[r["router"], _fmt(r["request_rate"]), _fmt(r.get("median_tpot_ms")), _fmt(r.get("p99_tpot_ms")),
             _fmt(r.get("median_ttft_ms")), _fmt(r.get("mean_active_experts_per_step"))] for r in doc["runs"]]
    return head, rows


def _replay_table(doc: dict) -> tuple[str, list[str], list[list[str]]] | None:
    """Fig. 13's numbers: per policy and batch size, then ELDR's share of the LB-to-oracle distance."""
    from eldr_cli.pipeline.replay import replay_rows

    res = doc.get("replay")
    if not res or not res.get("results"):
        return None
    head, rows = replay_rows(res)
    title = (f"Distinct active experts per layer per decode step -- trace REPLAY ({res['trace_source']} trace, "
             f"K={res['n_decoders']} decoders, {res['served_rows']} {res['split']} rows; no cost model)")
    return title, head, rows


def _share_table(doc: dict) -> tuple[list[str], list[list[str]]] | None:
    """Per simulated rate: TPOT p50 of the best load balancer, ELDR, the oracle, and ELDR's share (%)."""
    rows = [r for r in doc.get("oracle_share_by_rate") or [] if r.get("p50_tpot_ms")]
    if not rows:
        return None
    head = ["rate", "best LB TPOT p50 ms", "ELDR", "oracle", "ELDR share of LB->oracle"]
    out = []
    for r in rows:
        d = r["p50_tpot_ms"]
        out.append([_fmt(r["request_rate"]), _fmt(d.get("best_lb")), _fmt(d.get("eldr")), _fmt(d.get("oracle")),
                    "n/a" if d.get("share_pct") is None else f"{d['share_pct']:.0f}%"])
    return head, out


def _facts(doc: dict) -> list[tuple[str, str]]:
    t, f, s = doc["trace"], doc.get("fit") or {}, doc["simulated"]
    return [("model", str(t["model"])), ("requests", str(t["requests"])),
            ("layers x experts, top-k", f"{t['n_layers']} x {t['num_experts']}, top-{t['top_k']}"),
            ("domains", ", ".join(f"{k}: {v}" for k, v in t["domains"].items()) or "unlabelled"),
            ("signature transform", _fmt(f.get("transform"))), ("rho per transform", _fmt(f.get("rho_by_transform"))),
            ("layers kept (N*)", _fmt(f.get("n_layers_kept"))), ("cluster sizes", _fmt(f.get("cluster_sizes"))),
            ("cost model", s["cost_model"]), ("topology", f"{s['prefill']}P{s['decode']}D"),
            ("request rates (req/s)", ", ".join(_fmt(r) for r in s["rates"])),
            ("simulated duration per run", f"{s['duration_s']} s, {s['max_tokens']} decode tokens per request")]


def _group(figs: list[str]) -> list[tuple[str, list[str]]]:
    used, out = set(), []
    for title, keys in SECTIONS:
        # "fig1_" not "fig1": fig11_/fig13_ belong to their own sections, not to the trace's Fig. 1
        got = [f for f in figs if any(f.lower().startswith(k + "_") for k in keys) and f not in used]
        used.update(got)
        out.append((title, got))
    rest = [f for f in figs if f not in used]
    if rest:
        out.append(("Other figures", rest))
    return out


def render_md(doc: dict) -> str:
    v = doc["verdict"]
    lines = ["# eldr report", "", f"**Verdict (SIMULATED).** {v['text']}", "",
             "| verdict key | value |", "|---|---|"]
    lines += [f"| verdict.{k} | {_fmt(v[k])} |" for k in VERDICT_KEYS]
    lines += ["", "## Facts", "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in _facts(doc)]
    head, rows = _table(doc)
    lines += ["", "## Runs -- SIMULATED (" + doc["simulated"]["cost_model"] + ")", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    st = _share_table(doc)
    if st is not None:
        head, rows = st
        lines += ["", "## ELDR's share of the best-load-balancer-to-oracle distance per rate -- SIMULATED", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    rt = _replay_table(doc)
    if rt is not None:
        title, head, rows = rt
        lines += ["", f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    for title, figs in _group(doc["figures"]):
        lines += ["", f"## {title}", ""] + ([f"- {f} (embedded in report.html)" for f in figs] or
                                            ["(no figure: the input artifact has none)"])
    if doc["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def render_html(doc: dict, images: dict[str, str]) -> str:
    e = html.escape
    v = doc["verdict"]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>eldr report</title><style>",
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto}td,th{border:1px solid #ccc;"
             "padding:2px 6px}table{border-collapse:collapse}img{max-width:100%}.sim{color:#a33;font-weight:bold}",
             "</style></head><body><h1>eldr report</h1>",
             f"<p><span class='sim'>SIMULATED</span> {e(v['text'])}</p><table id='verdict'>"]
    parts += [f"<tr><td>verdict.{k}</td><td class='v' data-key='{k}'>{e(_fmt(v[k]))}</td></tr>" for k in VERDICT_KEYS]
    parts.append("</table><h2>Facts</h2><table>")
    parts += [f"<tr><td>{e(a)}</td><td>{e(b)}</td></tr>" for a, b in _facts(doc)]
    head, rows = _table(doc)
    parts.append(f"</table><h2>Runs <span class='sim'>SIMULATED</span> ({e(doc['simulated']['cost_model'])})</h2>"
                 "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    parts.append("</table>")
    st = _share_table(doc)
    if st is not None:
        head, rows = st
        parts.append("<h2>ELDR's share of the best-load-balancer-to-oracle distance per rate <span class='sim'>"
                     "SIMULATED</span></h2><table id='oracle-share'><tr>" + "".join(f"<th>{e(h)}</th>" for h in head)
                     + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    rt = _replay_table(doc)
    if rt is not None:
        title, head, rows = rt
        parts.append(f"<h2>{e(title)}</h2><table id='replay'><tr>" + "".join(f"<th>{e(h)}</th>" for h in head)
                     + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    for title, figs in _group(doc["figures"]):
        parts.append(f"<h2>{e(title)}</h2>")
        if not figs:
            parts.append("<p>(no figure: the input artifact has none)</p>")
        parts += [f"<figure><img alt='{e(f)}' src='data:image/png;base64,{images[f]}'><figcaption>{e(f)}"
                  "</figcaption></figure>" for f in figs]
    if doc["notes"]:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in doc["notes"]) + "</ul>")
    return "\n".join(parts) + "</body></html>\n"
