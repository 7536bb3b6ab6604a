"""The bench artifact (kind "bench", manifests/bench.v1.schema.json), the router comparison and the
summary tables. `bench serve`, `bench sweep` and `bench simulate` all write this one schema; ``mode``
(real | emulated | simulated) says where the numbers come from and is shown in every table and figure.

Files: ``requests.parquet`` (one row per request, all runs), ``summary.json`` (``runs``: one
`vllm bench serve`-style summary per (router, rate); ``comparison``: per router mean over rates and %
change vs round-robin and vs the best load balancer), ``steps.parquet`` (emulated/simulated: one row
per decode step and worker: batch, active experts, step ms), ``fig11_sweep.png``,
``fig13_active_experts.png``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eldr_cli.bench.figures import MODE_LABEL
from eldr_cli.errors import EldrError
from eldr_cli.routing import LOAD_BALANCERS

MODES = ("real", "emulated", "simulated")
HEADLINE = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms")


def _pct(x, ref):
    if x is None or ref is None or not ref:
        return None
    return 100.0 * (x - ref) / ref


def comparison(runs: list[dict]) -> list[dict]:
    """Per router: each headline metric's mean over rates and its mean per-rate % change against
    round-robin and against the best load balancer at that rate (ELDR §6.1 reports the mean over rates)."""
    routers = list(dict.fromkeys(r["router"] for r in runs))
    rates = sorted({r["request_rate"] for r in runs})
    by = {(r["router"], r["request_rate"]): r for r in runs}
    out = []
    for name in routers:
        row: dict = {"router": name, "rates": [x for x in rates if (name, x) in by],
                     "failed": sum(by[(name, x)]["failed"] for x in rates if (name, x) in by),
                     "completed": sum(by[(name, x)]["completed"] for x in rates if (name, x) in by)}
        for key in HEADLINE:
            vals: list[float] = []
            d_rr: list[float | None] = []
            d_lb: list[float | None] = []
            for x in rates:
                r = by.get((name, x))
                if r is None or r.get(key) is None:
                    continue
                vals.append(r[key])
                rr = by.get(("round-robin", x), {}).get(key)
                lbs = [by[(lb, x)][key] for lb in LOAD_BALANCERS if (lb, x) in by and by[(lb, x)].get(key) is not None]
                d_rr.append(_pct(r[key], rr))
                d_lb.append(_pct(r[key], min(lbs)) if lbs else None)
            row[key] = float(np.mean(vals)) if vals else None
            rr_ok = [v for v in d_rr if v is not None]
            lb_ok = [v for v in d_lb if v is not None]
            row[f"{key}_pct_vs_rr"] = float(np.mean(rr_ok)) if rr_ok and "round-robin" in routers else None
            row[f"{key}_pct_vs_best_lb"] = float(np.mean(lb_ok)) if lb_ok else None
        out.append(row)
    return out


def write_bench(out: str | os.PathLike, *, mode: str, params: dict, runs: list[dict], requests, steps=None,
                inputs: dict | None = None, title: str = "", n_layers: int | None = None,
                num_experts: int | None = None, extra: dict | None = None) -> Path:
    from eldr_cli.artifacts.store import ArtifactWriter
    from eldr_cli.bench import figures

    if mode not in MODES:
        raise EldrError(f"unknown bench mode {mode!r}")
    comp = comparison(runs)
    summary = {"mode": mode, "label": MODE_LABEL[mode], "runs": runs, "comparison": comp, **(extra or {})}
    routers = list(dict.fromkeys(r["router"] for r in runs))
    with ArtifactWriter(out, kind="bench", params={"mode": mode, "label": MODE_LABEL[mode], "routers": routers,
                                                   **params}, inputs=inputs) as w:
        w.write_table("requests", requests)
        if steps is not None and len(steps):
            w.write_table("steps", steps)
        w.write_json("summary.json", summary)
        w.metrics.update({
            "mode": mode, "runs": len(runs), "requests": int(len(requests)),
            "completed": int(sum(r["completed"] for r in runs)), "failed": int(sum(r["failed"] for r in runs)),
            "median_tpot_ms": {c["router"]: c["median_tpot_ms"] for c in comp},
            "p99_tpot_ms": {c["router"]: c["p99_tpot_ms"] for c in comp},
            "median_tpot_pct_vs_best_lb": {c["router"]: c["median_tpot_ms_pct_vs_best_lb"] for c in comp},
        })
        if runs:
            figures.sweep_figure(w.figure_path("fig11_sweep.png"), runs, mode, title)
        if steps is not None and len(steps) and n_layers:
            import polars as pl

            per = {}
            for name in routers:
                s = steps.filter(pl.col("router") == name)
                per[name] = (s["batch"].to_numpy(), s["active_experts"].to_numpy())
            figures.active_experts_figure(w.figure_path("fig13_active_experts.png"), per, mode, n_layers,
                                          num_experts or 0, title)
    return Path(out)


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def _signed(v):
    return "-" if v is None else f"{v:+.1f}%"


def runs_table(runs: list[dict], mode: str, *, wide: bool = True):
    """Per (router, rate); ``wide`` adds ITL, E2EL, throughput and schedule lag (80 columns without)."""
    from eldr_cli.console import table

    cols = ["router", "rate", "done", "failed", "TTFT p50", "TPOT p50", "TPOT p99"]
    if wide:
        cols += ["ITL p50", "E2EL p50", "tok/s", "lag p50"]
    t = table(*cols, title=f"per rate (ms) -- {MODE_LABEL[mode]}")
    for r in runs:
        failed = r["failed"]
        row = [r["router"], _f(r["request_rate"], "{:g}"), str(r["completed"]),
               f"[red]{failed}[/]" if failed else "0", _f(r.get("median_ttft_ms")), _f(r.get("median_tpot_ms")),
               _f(r.get("p99_tpot_ms"))]
        if wide:
            row += [_f(r.get("median_itl_ms")), _f(r.get("median_e2el_ms"), "{:.0f}"),
                    _f(r.get("output_throughput"), "{:.0f}"), _f(r.get("median_schedule_lag_ms"), "{:.2f}")]
        t.add_row(*row)
    return t


def comparison_table(comp: list[dict], mode: str, *, wide: bool = True):
    """Per router, mean over rates; ``wide`` adds the % vs round-robin of TPOT p99 and the TTFT columns."""
    from eldr_cli.console import table

    cols = ["router", "TPOT p50", "vs RR", "vs LB", "TPOT p99"] + (["vs RR"] if wide else []) + ["vs LB"]
    cols += (["TTFT p50", "vs RR"] if wide else []) + ["failed"]
    t = table(*cols, title=f"routers, mean over rates (ms) -- {MODE_LABEL[mode]}; "
                           "% vs round-robin (RR) and vs the best load balancer (LB)")
    for c in comp:
        row = [c["router"], _f(c["median_tpot_ms"]), _signed(c["median_tpot_ms_pct_vs_rr"]),
               _signed(c["median_tpot_ms_pct_vs_best_lb"]), _f(c["p99_tpot_ms"])]
        row += [_signed(c["p99_tpot_ms_pct_vs_rr"])] if wide else []
        row += [_signed(c["p99_tpot_ms_pct_vs_best_lb"])]
        row += [_f(c["median_ttft_ms"]), _signed(c["median_ttft_ms_pct_vs_rr"])] if wide else []
        row += [f"[red]{c['failed']}[/]" if c["failed"] else "0"]
        t.add_row(*row)
    return t


def oracle_table(rows: list[dict], mode: str):
    """Per rate: TPOT p50 and active experts of the best load balancer, ELDR and the oracle, and the share
    (%) of the balancer-to-oracle distance ELDR covers (``summary.json`` ``oracle_share``)."""
    from eldr_cli.console import table

    t = table("rate", "TPOT LB", "eldr", "oracle", "share", "experts LB", "eldr", "oracle", "share",
              title=f"ELDR's share of the best-LB-to-oracle distance -- {MODE_LABEL[mode]}")
    for r in rows:
        cells = [_f(r["request_rate"], "{:g}")]
        for m in ("p50_tpot_ms", "mean_active_experts_per_step"):
            d = r.get(m) or {}
            cells += [_f(d.get("best_lb")), _f(d.get("eldr")), _f(d.get("oracle")),
                      "n/a" if d.get("share_pct") is None else f"{d['share_pct']:.0f}%"]
        t.add_row(*cells)
    return t


def print_bench(path: str | os.PathLike, console=None, *, wide: bool = False) -> dict:
    """Print an existing bench artifact's tables; returns its summary.

    The tables fit 80 columns; their optional columns show with ``wide`` or on a wide enough
    console (always when stdout is not a terminal)."""
    import json

    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console as default
    from eldr_cli.console import show_wide

    con = console or default
    art = Artifact(path, kind="bench")
    summary = json.loads((Path(path) / "summary.json").read_text())
    mode = art.params["mode"]
    wide = show_wide(wide, con)
    con.print(runs_table(summary["runs"], mode, wide=wide))
    if len(summary["comparison"]) > 1:
        con.print(comparison_table(summary["comparison"], mode, wide=wide))
    failed = sum(r["failed"] for r in summary["runs"])
    if failed:
        con.print(f"[bold red]{failed} measured requests failed[/] (by outcome: "
                  + ", ".join(f"{r['router']}@{r['request_rate']:g}: {r['failed_by_outcome']}"
                              for r in summary["runs"] if r["failed"])
                  + "); latency percentiles cover the completed ones")
    if summary.get("oracle_share"):
        con.print(oracle_table(summary["oracle_share"], mode))
    wrapped = sum(int(r.get("wrapped_requests") or 0) for r in summary["runs"])
    if wrapped:
        con.print(f"{wrapped} requests asked for more tokens than their trace row captured: their decode steps "
                  "past the captured ones replay those again from the first (wrapped_requests per run)")
    unmatched = sum(int(r.get("unmatched") or 0) for r in summary["runs"])
    if unmatched:
        con.print(f"[yellow]{unmatched} prompts matched no trace row[/] and replayed row crc32(prompt) mod R")
    figs = sorted(p.name for p in Path(path).glob("*.png"))
    con.print(f"[bold]{MODE_LABEL[mode]}[/] results -> {path}" + (f"  figures: {', '.join(figs)}" if figs else ""))
    return summary
