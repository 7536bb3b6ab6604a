"""`eldr report`: one self-contained HTML/Markdown/JSON report of what ELDR is predicted to buy on a trace."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import split_option


def report_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace artifact (captured, imported or generated) with "
                                                    "per-step decode picks."),
    out: Path = typer.Option(..., "--out", help="Report directory (report.html, report.md, report.json)."),
    fit: Optional[Path] = typer.Option(None, "--fit", help="Fit (or routing) artifact; fitted on the trace if absent."),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="Cost-model artifact; default: the "
                                              "roofline of the preset model of the trace's shape on H100-SXM."),
    rates: Optional[str] = typer.Option(None, "--rates", help="Request rates (req/s); default: 25-100% of the "
                                        "estimated decode saturation rate."),
    prefill: Optional[int] = typer.Option(None, "--prefill", min=1, help="Prefill workers (default 2)."),
    decode: Optional[int] = typer.Option(None, "--decode", min=1, help="Decode workers (default 4)."),
    duration: float = typer.Option(30.0, "--duration", min=1.0, help="Simulated measured seconds per rate."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1,
                                             help="Decode tokens per request (default: the trace's median steps)."),
    split: str = split_option("evaluation", help="Trace rows to serve (falls back to all when absent)."),
    seed: int = typer.Option(0, "--seed"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Predict (SIMULATED) what ELDR buys on this trace and cost model: TPOT, TTFT, active experts, oracle share."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from eldr_cli.bench.workload import parse_rates
    from eldr_cli.console import console
    from eldr_cli.pipeline.report import STAGES, run_report

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("report", total=len(STAGES))
        seen: list[str] = []

        def step(name: str) -> None:
            if seen:
                bar.advance(task)
            seen.append(name)
            bar.update(task, description=f"report: {name}")

        v = run_report(trace, out, fit=fit, cost_model=cost_model, rates=parse_rates(rates) if rates else None,
                       prefill=prefill, decode=decode, duration_s=duration, max_tokens=max_tokens, split=split,
                       seed=seed, progress=step)
        bar.advance(task)
    console.print(v["text"])
    console.print(f"report -> {out / 'report.html'}  (also report.md, report.json)")


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
