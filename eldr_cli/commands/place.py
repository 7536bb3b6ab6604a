"""`eldr place-experts` (per-decoder EP expert placement, ELDR §5) and `eldr place-experts evaluate`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import checked, force_option, replacing, split_option, tau_option
from eldr_cli.routing.registry import policy_help

place_app = typer.Typer(
    help="Per-decoder expert placement for expert-parallel decoders (ELDR §5) + global EPLB and contiguous "
         "baselines. `eldr place-experts --trace T --routing D --ep-size R --out P`; "
         "`eldr place-experts evaluate ...` replays held-out decode and scores the layouts.",
    invoke_without_command=True,
    no_args_is_help=False,
)


@place_app.callback()
def place_cmd(
    ctx: typer.Context,
    trace: Optional[Path] = typer.Option(None, "--trace", help="Trace artifact the routing artifact was fitted on."),
    routing: Optional[Path] = typer.Option(None, "--routing", help="Routing artifact (or fit directory)."),
    ep_size: Optional[int] = typer.Option(None, "--ep-size", "-R", callback=checked("ep_size"),
                                           help="EP ranks per decoder; must divide E."),
    out: Path = typer.Option(Path("artifacts/placement"), "--out"),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", "-B", callback=checked("batch_size"),
        help="Balance the chance an expert is active in a step of B tokens, 1-(1-p)^B, instead of p."),
    redundant_experts: int = typer.Option(
        0, "--redundant-experts", callback=checked("n_redundant"),
        help="Extra physical slots per layer for the global EPLB baseline (E + this must be a multiple of R)."),
    decoders: Optional[int] = typer.Option(None, "--decoders", "-k", callback=checked("n_clusters"),
                                           help="Expected K; checked against the routing artifact."),
    figures: bool = typer.Option(True, "--figures/--no-figures"),
    force: bool = force_option(),
) -> None:
    """Fit per-decoder placement, global EPLB and contiguous layouts; export one vLLM EPLB map per decoder."""
    if ctx.invoked_subcommand is not None:
        return
    from eldr_cli.errors import EldrError

    missing = [n for n, v in (("--trace", trace), ("--routing", routing), ("--ep-size", ep_size)) if v is None]
    if missing:
        raise EldrError(f"place-experts needs {', '.join(missing)}",
                        hint="eldr place-experts --trace T --routing D --ep-size R --out P")
    from eldr_cli.pipeline.place import run_place_experts

    assert trace is not None and routing is not None and ep_size is not None  # checked just above
    with replacing(out, force):
        run_place_experts(trace, routing, out, ep_size=ep_size, batch_size=batch_size,
                          redundant_experts=redundant_experts, decoders=decoders, figures=figures)
    _print_placement(out)


@place_app.command("evaluate")
def evaluate_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace with per-step decode picks (evaluation split)."),
    routing: Path = typer.Option(..., "--routing", help="Routing artifact the placement was fitted with."),
    placement: Path = typer.Option(..., "--placement", help="Placement artifact (from `eldr place-experts`)."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="Evaluation artifact (default: PLACEMENT/../placement-eval)."),
    batch_size: int = typer.Option(8, "--batch-size", "-B", callback=checked("batch_size"),
                                   help="Decode concurrency per decoder (K*B in flight)."),
    policy: str = typer.Option("eldr", "--policy", help=policy_help()),
    tau: Optional[float] = tau_option(),
    split: str = split_option("evaluation", help="Requests to replay."),
    seed: int = typer.Option(0, "--seed"),
    figures: bool = typer.Option(True, "--figures/--no-figures"),
    force: bool = force_option(),
) -> None:
    """Replay held-out decode through the routing policy; max activated experts per EP rank per step."""
    from eldr_cli.pipeline.evaluate import run_evaluate_placement

    out = out or placement.parent / "placement-eval"
    with replacing(out, force):
        run_evaluate_placement(trace, routing, placement, out, batch_size=batch_size, policy=policy, tau=tau,
                               split=split, seed=seed, figures=figures)
    _print_eval(out)


def _print_placement(path: Path) -> None:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console

    a = Artifact(path, kind="placement")
    p, m = a.params, a.metrics
    share = m["expected_max_rank_share"]
    console.print(f"[green]placement[/] K={p['n_decoders']} decoders x L={p['num_layers']} x E={p['num_experts']} "
                  f"on R={p['ep_size']} ranks ({p['experts_per_rank']} experts/rank) in {m['place_s']:.3f} s -> {path}")
    console.print("expected heaviest-rank / mean-rank activation per (decoder, layer): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in share.items()))
    if m.get("empty_decoders"):
        console.print(f"[yellow]decoders without calibration requests (given the all-traffic placement):[/] "
                      f"{m['empty_decoders']}")
    console.print(f"vLLM EPLB maps: {path / 'export'}/decoder-XX.json (see README: vLLM has no load path)")


def _print_eval(path: Path) -> None:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console, table

    a = Artifact(path, kind="placement-eval")
    m, p = a.metrics, a.params
    src = m["trace_source"]
    t = table("layout", "mean", "gap to ceil(active/R)",
              title=f"max activated experts per EP rank per decode step (R={p['ep_size']}, policy {p['policy']}, "
                    f"B={p['batch_size']}; {'GENERATED' if src == 'generated' else src} trace)")
    names = {"contiguous": "contiguous", "global_eplb": "global EPLB", "per_decoder": "per-decoder"}
    for k, n in names.items():
        t.add_row(n, f"{m['mean_max_active_per_rank'][k]:.3f}", f"{100 * m['gap_to_lower_bound'][k]:+.1f}%")
    t.add_row("lower bound", f"{m['mean_lower_bound']:.3f}", "")
    console.print(t)
    console.print(f"{m['n_batch_steps']} batch steps of {m['n_requests']} requests, mean batch "
                  f"{m['mean_batch_size']:.1f}, mean active experts/layer {m['mean_active_experts']:.1f}; "
                  f"per-decoder vs contiguous {100 * m['per_decoder_vs_contiguous']:+.1f}%, vs global EPLB "
                  f"{100 * m['per_decoder_vs_global_eplb']:+.1f}% -> {path}")


def register(app: typer.Typer) -> None:
    app.add_typer(place_app, name="place-experts")
