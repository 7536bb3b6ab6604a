"""`eldr fit --from-decision-log`: refit a routing artifact's clusters on the signatures the proxy logged.

A decision log (``--decision-log-replay`` rows) holds each served request's handed-off prefill counts but
no decode steps, and the layer selection (Eq. 1's rho) and eldr-live's decode-activation model both need
decode. So the refit keeps the serving artifact's signature space (transform, per-cell weights, layer
mask) and its eldr-live model, and fits again what the traffic decides: the balanced K-means centroids
(K may change with the decode pool) and the drift figures. Signature quality (rho) is therefore the
serving artifact's by construction; what changes is how the clusters fit and balance the served mix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError


def logged_counts(log, shape: tuple[int, int]) -> tuple[np.ndarray, dict[str, int]]:
    """int [R, L, E] prefill counts of every replay row with a signature of ``shape`` (rows of any routing
    artifact: the counts do not depend on it), and the rows skipped by reason."""
    from eldr_cli.handoff import SignatureDecodeError, decode_counts
    from eldr_cli.pipeline.decision_replay import REPLAY_OPTION, read_rows

    rows = read_rows(log)
    if not rows:
        raise EldrError(f"decision log {log} is empty", hint=f"serve some traffic with `{REPLAY_OPTION}`")
    skipped = {"truncated": int(rows[0].pop("_truncated", 0) or 0), "without replay fields": 0,
               "without signature": 0, "other shape": 0}
    out = []
    for r in rows:
        if "sig" not in r or "log_v" not in r:
            skipped["without replay fields"] += 1
            continue
        if not isinstance(r["sig"], dict):
            skipped["without signature"] += 1
            continue
        try:
            c = decode_counts({"v": 1, "encoding": "zlib+b64", **r["sig"]})
        except SignatureDecodeError:
            skipped["without signature"] += 1
            continue
        if c.shape != shape:
            skipped["other shape"] += 1
            continue
        out.append(c)
    if skipped["without replay fields"] == len(rows):
        raise EldrError(f"decision log {log} has no signatures (rows without the replay fields: written by an "
                        "older proxy or without --decision-log-replay)", hint=f"serve with `{REPLAY_OPTION}`")
    if not out:
        raise EldrError(f"no row of decision log {log} carries a signature of the routing artifact's shape "
                        f"L={shape[0]}, E={shape[1]}")
    return np.stack(out).astype(np.int32), skipped


def run_fit_from_log(log, out, *, routing, decoders: int | None = None, tau: float | None = None,
                     seed: int = 0) -> Path:
    """Write a routing artifact at ``out``: ``routing``'s signature space and eldr-live model, balanced
    K-means centroids (``decoders`` clusters; default the artifact's K) fitted on the logged signatures."""
    from eldr_cli.artifacts.store import ArtifactWriter
    from eldr_cli.method.cluster import BalancedKMeans
    from eldr_cli.method.signature import signatures
    from eldr_cli.pipeline import checks
    from eldr_cli.routing import RoutingModel
    from eldr_cli.routing.drift import calibration_stats
    from eldr_cli.routing.live import band_prior_weight
    from eldr_cli.routing.model import load_routing_artifact

    if routing is None:
        raise EldrError("--from-decision-log needs --routing: the routing artifact whose signature space (and "
                        "eldr-live model) the refit keeps")
    src = load_routing_artifact(routing)
    model = RoutingModel.load(routing)
    K = int(decoders or model.n_clusters)
    tau = model.tau if tau is None else float(tau)
    checks.check_tau(tau)
    counts, skipped = logged_counts(log, model.shape)
    S = signatures(counts, model.transform, model.weights, model.mask)
    S = S[np.linalg.norm(S, axis=1) > 0]
    checks.check_k_range(K, len(S))
    km = BalancedKMeans(K, seed=seed).fit(S)
    protos = None if model.live is None else model.live[0]
    p = dict(src.params)
    drift = calibration_stats(S, km.centroids_, protos, tau)
    p.update({"n_clusters": K, "tau": tau, "seed": seed, "balanced": True, "split": "decision-log",
              "drift": drift, "band_prior": 0.0 if model.live is None else band_prior_weight(drift, tau),
              "refit": {"from": "decision-log", "rows": int(len(S)), "skipped": skipped}})
    with ArtifactWriter(out, kind="routing", params=p, inputs={"decision_log": str(log), "routing": str(routing)}) as w:
        w.write_array("weights", model.weights)
        w.write_array("idf", src.array("idf"))
        w.write_array("mask", src.array("mask"))
        w.write_array("centroids", km.centroids_)
        w.write_array("labels", np.asarray(km.labels_, dtype=np.int32))
        if model.live is not None:
            w.write_array("live_prototypes", src.array("live_prototypes"))
            w.write_array("live_activation", src.array("live_activation"))
            if src.params.get("live_predictor"):
                w.write_array("live_kappa", src.array("live_kappa"))
                w.write_array("live_weight", src.array("live_weight"))
        w.metrics.update({"cluster_sizes": km.sizes_.tolist(), "objective": km.objective_,
                          "mean_cosine_distance": km.objective_ / len(S), "capacity": km.capacity_,
                          "n_iter": km.n_iter_, "n_signatures": int(len(S)), "fit_s": 0.0})
    return Path(out)
