"""`eldr report`: capacity at SLO per router, with confidence intervals over seeds, as one self-contained
HTML/Markdown/JSON report of what ELDR is predicted (SIMULATED) to buy on a trace."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import split_option


def report_cmd(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Trace artifact (captured, imported or generated) "
                                                             "with per-step decode picks."),
    decision_log: Optional[Path] = typer.Option(None, "--decision-log", help="Instead of --trace: the proxy's "
                                                "decision log (--decision-log-replay rows); needs --fit."),
    out: Path = typer.Option(..., "--out", help="Report directory (report.html, report.md, report.json)."),
    fit: Optional[Path] = typer.Option(None, "--fit", help="Fit (or routing) artifact; fitted on the trace if absent."),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="Cost-model artifact; default: the "
                                              "roofline of the preset model of the trace's shape on H100-SXM."),
    seeds: int = typer.Option(5, "--seeds", help="Independent runs (arrivals, row order, policy seeds), paired "
                                                 "across routers; every figure is their mean and 95% interval."),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="TPOT p90 target (ms); default: 4x "
                                                "the batch-1 decode step of the cost model."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="TTFT p90 target (ms); default: 3x "
                                                "the p90 prompt's prefill step + 2 TPOT targets."),
    routers: Optional[str] = typer.Option(None, "--routers", help="Comma-separated routers (default: every "
                                          "simulator router but domain, incl. the oracle)."),
    prefill: Optional[int] = typer.Option(None, "--prefill", min=1, help="Prefill workers (default: enough that "
                                          "TTFT does not limit capacity)."),
    decode: Optional[int] = typer.Option(None, "--decode", min=1, help="Decode workers (default 4, or the fit's K)."),
    duration: Optional[float] = typer.Option(None, "--duration", min=0.1, help="Shortest measured window per "
                                             "simulated run (s); default: 3 request lifetimes at the TPOT "
                                             "target. Each run measures 300 to 2,000 requests."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1,
                                             help="Decode tokens per request (default: the trace's median steps)."),
    split: str = split_option("evaluation", help="Trace rows to serve (falls back to all when absent)."),
    seed: int = typer.Option(0, "--seed", help="First seed (seeds are seed, seed+1, ...)."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Capacity at SLO per router (SIMULATED, paired seeds, 95% intervals), load regimes, the verdict."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from eldr_cli.console import console
    from eldr_cli.report.run import STAGES

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("report", total=len(STAGES))
        seen: list[str] = []

        def step(name: str) -> None:
            if seen:
                bar.advance(task)
            seen.append(name)
            bar.update(task, description=f"report: {name}")

        names = [r.strip() for r in routers.split(",") if r.strip()] if routers else None
        kw = dict(cost_model=cost_model, prefill=prefill, decode=decode, routers=names, seeds=seeds,
                  slo_tpot_ms=slo_tpot_ms, slo_ttft_ms=slo_ttft_ms, duration_s=duration or 0.0, max_tokens=max_tokens,
                  seed=seed, progress=step)
        v = _run(trace, decision_log, out, fit, split, kw)
        bar.advance(task)
    from eldr_cli.console import table
    from eldr_cli.report.render import capacity_table

    _, head, rows = capacity_table(v)
    t = table(*head, title="capacity at SLO -- SIMULATED, mean [95% interval]")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    console.print(v["text"])
    if "decision_log" in v:
        sec = v["decision_log"]
        console.print(f"decision log: {sec['rows_used']} requests replayed, logged load {sec['logged_rate_rps']:.3g} "
                      f"req/s = {sec['logged_load_pct_of_best_lb']}% of the best load balancer's capacity; "
                      "decode picks GENERATED")
        lt = sec.get("logged_tpot") or {}
        console.print("logged TPOT vs the cost model: " + (f"mean |error| {lt['mean_abs_error_pct']:.0f}% over "
                      f"{len(lt['per_decoder'])} decoders" if "per_decoder" in lt else lt.get("note", "n/a")))
        if sec["drift"].get("drifted"):
            console.print("[red]drift:[/] " + "; ".join(sec["drift"]["reasons"]))
    console.print(f"report -> {out / 'report.html'}  (also report.md, report.json)")


def _run(trace, decision_log, out, fit, split, kw) -> dict:
    from eldr_cli.errors import EldrError
    from eldr_cli.report.run import run_report

    if (trace is None) == (decision_log is None):
        raise EldrError("give one of --trace (a trace artifact) or --decision-log (the proxy's decision log)")
    if decision_log is not None:
        from eldr_cli.report.decision_log import run_report_from_log

        return run_report_from_log(decision_log, out, fit=fit, **kw)
    return run_report(trace, out, fit=fit, split=split, **kw)


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
