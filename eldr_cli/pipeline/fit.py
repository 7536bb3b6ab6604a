"""The offline fit as artifact-to-artifact stages: fit-idf -> select-layers -> cluster (and fit).

Each ``run_*`` function reads its input artifacts, calls the estimators in ``eldr_cli.method``,
and writes one artifact atomically; the CLI commands are thin wrappers around them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.artifacts.trace import Trace, read_trace
from eldr_cli.errors import EldrError
from eldr_cli.method.signature import blas_threads
from eldr_cli.pipeline import checks


def _fit_rows(trace: Trace, split: str) -> np.ndarray:
    return np.flatnonzero(trace.split_mask(split))


def _preload_plots():
    """Import matplotlib in a background thread while the fit computes: the import is ~0.5 s of the
    command, and the numpy work it overlaps releases the GIL. -> the thread (join it before leaving)."""
    import threading

    from eldr_cli import plots

    thread = threading.Thread(target=plots.plt, name="eldr-preload-plots", daemon=True)
    thread.start()
    return thread


def run_fit_idf(trace_path: str | os.PathLike, out: str | os.PathLike, *, split: str = "calibration",
                trace: Trace | None = None) -> Path:
    from eldr_cli.method.idf import ExpertIDF

    trace = trace or read_trace(trace_path, with_picks=False)
    rows = _fit_rows(trace, split)
    est = ExpertIDF().fit(trace.prefill_counts[rows])
    with ArtifactWriter(out, kind="idf", params={"transform": "count-idf", "split": split},
                        inputs={"trace": trace_path}) as w:
        w.write_array("idf", est.idf_)
        w.write_array("df", est.df_.astype(np.int32))
        w.metrics.update({"n_requests": est.n_requests_, "idf_min": float(est.idf_.min()),
                          "idf_max": float(est.idf_.max()),
                          "cells_never_fired": int((est.df_ == 0).sum())})
    return Path(out)


def run_select_layers(trace_path, idf_path, out, *, pairs: int = 20000, transform: str = "auto",
                      seed: int = 0, split: str = "calibration", trace: Trace | None = None,
                      figures: bool = True) -> Path:
    from eldr_cli.method.layers import LayerSelector

    trace = trace or read_trace(trace_path, with_picks=False)
    idf_art = Artifact(idf_path, kind="idf")
    checks.check_same_trace(idf_art, trace, "IDF artifact")
    idf = idf_art.array("idf")
    if idf.shape != (trace.num_layers, trace.num_experts):
        raise EldrError(f"IDF table is {idf.shape}, the trace is L={trace.num_layers}, E={trace.num_experts}")
    rows = _fit_rows(trace, split)
    gates = {"gate-prob": trace.prefill_gate_prob, "gate-logit": trace.prefill_gate_logit}
    gates = {k: v[rows] for k, v in gates.items() if v is not None}
    t0 = time.perf_counter()
    with blas_threads(1):
        sel = LayerSelector(transform=transform, n_pairs=pairs, seed=seed).fit(
            trace.prefill_counts[rows], trace.decode_counts[rows], trace.decode_steps[rows], idf, gates)
    fit_s = time.perf_counter() - t0
    with ArtifactWriter(out, kind="layers", params={"transform": sel.transform_, "requested_transform": transform,
                                                    "pairs": pairs, "seed": seed, "split": split},
                        inputs={"trace": trace_path, "idf": idf_path}) as w:
        w.write_array("order", sel.order_)
        w.write_array("cumulative_rho", sel.cumulative_rho_)
        w.write_array("mask", sel.mask_)
        w.write_array("weights", sel.weights_)
        w.write_array("idf", idf)
        w.metrics.update({"n_layers_kept": sel.n_layers_, "num_layers": trace.num_layers,
                          "rho_by_transform": sel.rho_by_transform_, "rho_peak": sel.rho_peak_,
                          "rho_all_layers": sel.rho_all_layers_, "n_requests": sel.n_requests_,
                          "layer_weights": [round(float(v), 4) for v in sel.layer_weights_],
                          "layer_weight_rho": sel.weight_rho_,
                          "fit_s": round(fit_s, 4)})
        if figures:  # the two figures drawn side by side in forked processes (the same bytes)
            t_fig = time.perf_counter()
            from eldr_cli import plots

            with plots.Drawing() as drawing:
                drawing.submit(plots.rho_per_transform, w.figure_path("fig7_rho_per_transform.png"),
                               sel.rho_by_transform_, sel.transform_)
                drawing.submit(plots.cumulative_rho, w.figure_path("fig8_cumulative_rho.png"), sel.cumulative_rho_,
                               sel.n_layers_)
            w.metrics["figures_s"] = round(time.perf_counter() - t_fig, 4)
    return Path(out)


def run_cluster(trace_path, layers_path, out, *, decoders: int, vanilla: bool = False, seed: int = 0,
                tau: float = 0.1, max_iter: int = 50, split: str = "calibration", trace: Trace | None = None,
                figures: bool = True) -> Path:
    from eldr_cli import plots  # numpy only until a figure is drawn
    from eldr_cli.method.cluster import BalancedKMeans
    from eldr_cli.method.signature import signatures

    checks.check_tau(tau)
    trace = trace or read_trace(trace_path, with_picks=False)
    lay = Artifact(layers_path, kind="layers")
    checks.check_same_trace(lay, trace, "layers artifact")
    transform = lay.params["transform"]
    weights, mask = lay.array("weights"), lay.array("mask")
    rows = _fit_rows(trace, split)
    src = trace.gate(transform) if transform.startswith("gate") else trace.prefill_counts
    if src is None:
        raise EldrError(f"the layers artifact uses transform {transform}, but the trace has no gate sums",
                        hint="fit the layers on this trace or capture with gate sums")
    S = signatures(src[rows], transform, weights, mask)
    ok = np.linalg.norm(S, axis=1) > 0
    rows, S = np.asarray(rows[ok]), S[ok]
    checks.check_k_range(decoders, len(rows))
    with blas_threads(1):
        t0 = time.perf_counter()
        km = BalancedKMeans(decoders, balanced=not vanilla, max_iter=max_iter, seed=seed).fit(S)
        fit_s = time.perf_counter() - t0
    labels = np.full(trace.n_requests, -1, dtype=np.int32)
    assert km.labels_ is not None  # set by fit
    labels[rows] = km.labels_
    domains = trace.column("domain")[rows]
    names, counts = np.unique(domains, return_counts=True)
    share = {str(n): float(c) / len(rows) for n, c in zip(names, counts, strict=True)}
    with ArtifactWriter(out, kind="routing",
                        params={"transform": transform, "n_clusters": decoders, "tau": tau,
                                "balanced": not vanilla, "seed": seed, "max_iter": max_iter, "split": split,
                                "num_layers": trace.num_layers, "num_experts": trace.num_experts,
                                "top_k": trace.top_k, "model": trace.model.get("model"), "domain_share": share},
                        inputs={"trace": trace_path, "layers": layers_path}) as w, plots.Drawing() as drawing:
        for name, arr in (("weights", weights), ("idf", lay.array("idf")), ("mask", mask),
                          ("centroids", km.centroids_), ("labels", labels)):
            w.write_array(name, arr)
        w.metrics.update({"cluster_sizes": km.sizes_.tolist(), "objective": km.objective_,
                          "mean_cosine_distance": km.objective_ / len(rows), "capacity": km.capacity_,
                          "n_iter": km.n_iter_, "n_signatures": int(len(rows)), "fit_s": round(fit_s, 4)})
        t_fig = time.perf_counter()
        with blas_threads(1):  # the forked process draws with the caller's BLAS threads: the same bytes
            if figures:
                drawing.submit(plots.pca_clusters, w.figure_path("fig9_pca.png"), S, km.centroids_, domains)
            fig_s = time.perf_counter() - t_fig
            # eldr-live's decode-activation model, fitted while a forked process draws the figure
            live = _fit_decode_activation(S, trace, rows, seed)
        if figures:
            t_fig = time.perf_counter()
            drawing.wait()
            w.metrics["figures_s"] = round(fig_s + time.perf_counter() - t_fig, 4)
        _write_live(w, live, S, km.centroids_, tau)
    return Path(out)


def _write_live(w: ArtifactWriter, live, S: np.ndarray, centroids: np.ndarray, tau: float) -> None:
    """The routing artifact's parts that depend on eldr-live's decode-activation model (``live``, None when
    the calibration rows have no decode): the drift watch's calibration, the live predictor."""
    from eldr_cli.routing.drift import calibration_stats
    from eldr_cli.routing.live import band_prior_weight

    drift = calibration_stats(S, centroids, None if live is None else live.prototypes_, tau)
    w.params.update({"drift": drift, "band_prior": 0.0 if live is None else band_prior_weight(drift, tau),
                     "live_prototypes": None if live is None else int(live.prototypes_.shape[0]),
                     "live_predictor": None if live is None else live.predictor_})
    if live is not None:  # what the eldr-live policy predicts a request's decode experts from
        w.write_array("live_prototypes", live.prototypes_)
        w.write_array("live_activation", live.activation_)
        w.write_array("live_kappa", live.shrinkage_.kappa)
        w.write_array("live_weight", live.shrinkage_.weight)
        w.metrics["live_predictor_quality"] = live.quality_


def _fit_decode_activation(S: np.ndarray, trace: Trace, rows: np.ndarray, seed: int):
    """The eldr-live decode-activation model of the calibration rows (None when they have no decode)."""
    from eldr_cli.method.live import DecodeActivation

    steps = np.asarray(trace.decode_steps)[rows]
    if int((steps > 0).sum()) < 2:
        return None
    with blas_threads(1):
        return DecodeActivation(seed=seed).fit(S, np.asarray(trace.decode_counts[rows]), steps,
                                               np.asarray(trace.prefill_counts[rows]), trace.top_k)


def run_fit(trace_path, out, *, decoders: int, pairs: int = 20000, transform: str = "auto", seed: int = 0,
            tau: float = 0.1, vanilla: bool = False, split: str = "calibration", figures: bool = True) -> Path:
    """All three stages, each into its own sub-artifact of ``out``; ``out/routing`` is what the proxy loads.

    The whole directory is built beside ``out`` and renamed into place at the end. The manifest's
    ``phase_s`` splits the time (reading the trace, each stage with its figures, the manifests).
    """
    t_read = time.perf_counter()
    trace = read_trace(trace_path, with_picks=False)
    checks.check_k_range(decoders, int(trace.split_mask(split).sum()))  # fail before any work
    preload = _preload_plots() if figures else None
    out = Path(out)
    t0 = time.perf_counter()
    phase_s = {"read_trace": round(t0 - t_read, 4)}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phase_s[name] = round(now - since, 4)
        return now

    try:
        with ArtifactWriter(out, kind="fit", params={"decoders": decoders, "pairs": pairs, "transform": transform,
                                                     "seed": seed, "tau": tau, "vanilla": vanilla, "split": split},
                            inputs={"trace": trace_path}) as w:
            # sub-artifacts record the *final* paths of their inputs so `make` chains stay readable
            t = t0
            run_fit_idf(trace_path, w.path / "idf", split=split, trace=trace)
            t = lap("fit_idf", t)
            run_select_layers(trace_path, w.path / "idf", w.path / "layers", pairs=pairs, transform=transform,
                              seed=seed, split=split, trace=trace, figures=figures)
            t = lap("select_layers", t)
            run_cluster(trace_path, w.path / "layers", w.path / "routing", decoders=decoders, vanilla=vanilla,
                        seed=seed, tau=tau, split=split, trace=trace, figures=figures)
            t = lap("cluster", t)
            for sub in ("idf", "layers", "routing"):  # name final paths, not the temporary directory
                mf = w.path / sub / "manifest.json"
                mf.write_text(mf.read_text().replace(str(w.path), str(out)))
            lay = Artifact(w.path / "layers").metrics
            rt = Artifact(w.path / "routing").metrics
            w.metrics.update({"transform": Artifact(w.path / "layers").params["transform"],
                              "rho_by_transform": lay["rho_by_transform"], "n_layers_kept": lay["n_layers_kept"],
                              "rho_peak": lay["rho_peak"], "cluster_sizes": rt["cluster_sizes"],
                              "objective": rt["objective"],
                              "fit_s": round(time.perf_counter() - t0, 4), "phase_s": phase_s})
            lap("finish_manifests", t)
    finally:
        if preload is not None:  # never leave an import running in a daemon thread at exit
            preload.join()
    return out
