"""`eldr fit-idf`, `eldr select-layers`, `eldr cluster` and `eldr fit` (all three)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import (
    checked,
    declared,
    force_option,
    replacing,
    skip_teardown,
    split_option,
    tau_option,
)

TRACE = typer.Option(..., "--trace", help="Trace artifact (from `eldr capture`).")
SPLIT = split_option("calibration", help="Requests to fit on: calibration, evaluation or all.")
FORCE = force_option()
DECODERS = typer.Option(..., "--decoders", "-k", help="K = number of decode workers.")
PAIRS = typer.Option(20000, "--pairs", callback=checked("n_pairs"),
                     help=f"Fixed-seed request pairs for rho (Eq. 1). {declared('n_pairs')}")
TAU = tau_option(0.1, help="Default locality band width stored for the proxy.")


def fit_idf_cmd(trace: Path = TRACE, out: Path = typer.Option(Path("artifacts/fit/idf"), "--out"),
                split: str = SPLIT, force: bool = FORCE) -> None:
    """IDF weight of every (layer, expert) cell: w = log((|C|+1)/(df+1)) (ELDR §4.2.2)."""
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console
    from eldr_cli.pipeline.fit import run_fit_idf

    with replacing(out, force):
        run_fit_idf(trace, out, split=split)
    m = Artifact(out).metrics
    console.print(f"[green]idf[/] -> {out}: {m['n_requests']} requests, w in [{m['idf_min']:.3f}, "
                  f"{m['idf_max']:.3f}], {m['cells_never_fired']} cells never fired ({m['wall_time_s']:.2f} s)")
    skip_teardown()


def select_layers_cmd(
    trace: Path = TRACE,
    idf: Path = typer.Option(..., "--idf", help="IDF artifact (from `eldr fit-idf`)."),
    out: Path = typer.Option(Path("artifacts/fit/layers"), "--out"),
    pairs: int = PAIRS,
    transform: str = typer.Option("auto", "--transform",
                                  help="auto|count|count-idf|sqrt|binary|gate-prob|gate-logit"),
    seed: int = typer.Option(0, "--seed"),
    split: str = SPLIT,
    force: bool = FORCE,
) -> None:
    """Score signature transforms by rho and pick layers greedily; writes Fig. 7 and Fig. 8."""
    from eldr_cli.pipeline.fit import run_select_layers

    with replacing(out, force):
        run_select_layers(trace, idf, out, pairs=pairs, transform=transform, seed=seed, split=split)
    _print_layers(out)
    skip_teardown()


def cluster_cmd(
    trace: Path = TRACE,
    layers: Path = typer.Option(..., "--layers", help="Layers artifact (from `eldr select-layers`)."),
    decoders: int = DECODERS,
    out: Path = typer.Option(Path("artifacts/fit/routing"), "--out"),
    vanilla: bool = typer.Option(False, "--vanilla", help="Unconstrained K-means (ablation)."),
    tau: float = TAU,
    seed: int = typer.Option(0, "--seed"),
    split: str = SPLIT,
    force: bool = FORCE,
) -> None:
    """Balanced K-means (exact capacity-constrained assignment) -> the routing artifact; writes Fig. 9."""
    from eldr_cli.pipeline.fit import run_cluster

    with replacing(out, force):
        run_cluster(trace, layers, out, decoders=decoders, vanilla=vanilla, seed=seed, tau=tau, split=split)
    _print_routing(out)
    skip_teardown()


def fit_cmd(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Trace artifact (from `eldr capture`)."),
    decoders: Optional[int] = typer.Option(None, "--decoders", "-k", help="K = number of decode workers."),
    from_decision_log: Optional[Path] = typer.Option(
        None, "--from-decision-log", help="Instead of --trace: refit the clusters of --routing on the signatures "
                                          "the proxy logged (--decision-log-replay); writes a routing artifact."),
    routing: Optional[Path] = typer.Option(None, "--routing", help="With --from-decision-log: the serving routing "
                                           "artifact whose signature space and eldr-live model are kept."),
    out: Path = typer.Option(Path("artifacts/fit"), "--out"),
    pairs: int = PAIRS,
    transform: str = typer.Option("auto", "--transform"),
    tau: float = TAU,
    vanilla: bool = typer.Option(False, "--vanilla"),
    seed: int = typer.Option(0, "--seed"),
    split: str = SPLIT,
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Write Fig. 7, 8 and 9."),
    force: bool = FORCE,
) -> None:
    """fit-idf -> select-layers -> cluster in one go; OUT/routing is what `serve-proxy` loads."""
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console
    from eldr_cli.errors import EldrError
    from eldr_cli.pipeline.fit import run_fit

    if from_decision_log is not None:
        return _refit(from_decision_log, routing, out, decoders, tau, seed, force)
    if trace is None or decoders is None:
        flag = "--trace" if trace is None else "--decoders"
        raise EldrError(f"Missing option '{flag}' (or refit from a decision log: --from-decision-log LOG "
                        "--routing DIR)")
    with replacing(out, force):
        run_fit(trace, out, decoders=decoders, pairs=pairs, transform=transform, seed=seed, tau=tau,
                vanilla=vanilla, split=split, figures=figures)
    _print_layers(out / "layers")
    _print_routing(out / "routing")
    console.print(f"fit took {Artifact(out).metrics['fit_s']:.2f} s -> [bold]{out / 'routing'}[/]")
    skip_teardown()


def _refit(log: Path, routing, out: Path, decoders, tau, seed: int, force: bool) -> None:
    from eldr_cli.pipeline.refit import run_fit_from_log

    with replacing(out, force):
        run_fit_from_log(log, out, routing=routing, decoders=decoders, tau=tau, seed=seed)
    _print_routing(out)
    skip_teardown()


def _print_layers(path: Path) -> None:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console, table

    a = Artifact(path)
    m = a.metrics
    t = table("transform", "rho (all layers)", title=f"signature quality rho (Eq. 1), {a.params['pairs']} pairs")
    for k, v in sorted(m["rho_by_transform"].items(), key=lambda kv: -kv[1]):
        t.add_row(k + (" *" if k == a.params["transform"] else ""), f"{v:.4f}")
    console.print(t)
    console.print(f"layers kept N* = {m['n_layers_kept']} of {m['num_layers']}: rho {m['rho_all_layers']:.4f} -> "
                  f"{m['rho_peak']:.4f}; figures in {path}")
    wr = m.get("layer_weight_rho") or {}
    if wr:
        moved = [f"{i}:x{v:g}" for i, v in enumerate(m.get("layer_weights") or []) if v != 1]
        console.print(f"learned layer weights ({', '.join(moved) or 'none moved'}): rho on the held-out half of "
                      f"the pairs {wr['rho_plain_check_half']:.4f} -> {wr['rho_learned_check_half']:.4f}")


def _print_routing(path: Path) -> None:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console

    a = Artifact(path)
    m = a.metrics
    kind = "balanced" if a.params["balanced"] else "vanilla"
    console.print(f"[green]{kind} K-means[/] K={a.params['n_clusters']} on {m['n_signatures']} signatures: sizes "
                  f"{min(m['cluster_sizes'])}..{max(m['cluster_sizes'])} (cap {m['capacity']}), mean cosine "
                  f"distance {m['mean_cosine_distance']:.4f}, {m['n_iter']} iterations, {m['fit_s']:.2f} s -> {path}")
    _print_predictor(a.params.get("live_predictor"), m.get("live_predictor_quality"))
    _print_band_prior(a.params)


def _print_band_prior(p: dict) -> None:
    """Whether eldr-live ranks by the band under load, and the calibration figure that decided it."""
    from eldr_cli.console import console
    from eldr_cli.routing.live import BAND_TRUST, band_bar

    mean = ((p.get("drift") or {}).get("centroid") or {}).get("mean")
    if p.get("live_predictor") is None or mean is None:
        return
    bar = band_bar(p["tau"])
    w = float(p.get("band_prior") or 0.0)
    console.print(f"eldr-live band prior {w:g} under load: calibration requests' mean cosine to their centroid "
                  f"{mean:.3f} {'>=' if w else '<'} {bar:.3f} (1 - {BAND_TRUST:g} tau)")


def _print_predictor(chosen: str | None, quality: dict | None) -> None:
    """eldr-live's decode-activation predictors on the held-back split (issue 35), the served one starred."""
    from eldr_cli.console import console, table

    if chosen is None:
        console.print("eldr-live: no decode steps in the calibration rows, no decode-activation model")
        return
    if not quality:
        console.print(f"eldr-live predictor: {chosen} (too few calibration rows to hold any back)")
        return
    t = table("predictor", "Brier", "log-loss", "union err b8", "b32", "b64",
              title="eldr-live decode-activation predictor, held-back 25% of the calibration rows")
    order = ("prototype", "shrinkage-global", "shrinkage", "own", "knn-8", "clairvoyant")
    for name, q in sorted(quality.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99):
        t.add_row(name + (" *" if name == chosen else ""), f"{q['brier']:.5f}", f"{q['log_loss']:.4f}",
                  *(f"{q[f'union_err_pct_b{b}']:.1f}%" for b in (8, 32, 64)))
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command("fit-idf")(fit_idf_cmd)
    app.command("select-layers")(select_layers_cmd)
    app.command("cluster")(cluster_cmd)
    app.command("fit")(fit_cmd)
