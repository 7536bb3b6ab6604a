"""`eldr synth-trace`: a generated trace with known domain structure (no model needed)."""

from __future__ import annotations

from pathlib import Path

import typer

from eldr_cli.commands._common import force_option, replacing


def synth_trace_cmd(
    out: Path = typer.Option(Path("artifacts/synth-trace"), "--out"),
    requests: int = typer.Option(1000, "--requests", "-n", min=1),
    layers: int = typer.Option(48, "--layers", min=1),
    experts: int = typer.Option(128, "--experts", min=1),
    top_k: int = typer.Option(8, "--top-k", min=1),
    domains: int = typer.Option(4, "--domains", min=1),
    steps: int = typer.Option(128, "--decode-steps", min=1),
    picks: bool = typer.Option(False, "--picks/--no-picks", help="Keep per-step decode picks for replay."),
    seed: int = typer.Option(0, "--seed"),
    force: bool = force_option(),
) -> None:
    """Write a GENERATED trace (labelled model=synthetic) whose even layers carry domain signal."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.console import console
    from eldr_cli.errors import EldrError
    from eldr_cli.synth import synthetic_trace

    if top_k > experts:
        raise EldrError(f"--top-k ({top_k}) must not exceed --experts ({experts})")
    t = synthetic_trace(requests, layers, experts, top_k, n_domains=domains, decode_steps=steps,
                        with_picks=picks, seed=seed)
    with replacing(out, force):
        write_trace(out, t, params={"generator": "eldr.synth", "seed": seed})
    console.print(f"generated trace ({requests} requests, L={layers}, E={experts}, k={top_k}) -> {out}")


def register(app: typer.Typer) -> None:
    app.command("synth-trace")(synth_trace_cmd)
