"""`eldr place-experts evaluate`: replay held-out decode through the routing policy and score placements.

:func:`run_evaluate_placement` replays the trace's held-out decode steps: each request is routed to a
decoder by the decode router (:func:`eldr_cli.routing.make_router`), decoders run
continuous decode batches (:func:`replay_batches`), and every batch step is scored by the METRO metric
(max activated experts on any EP rank) for the three layouts of a ``placement`` artifact, against the
bound ceil(active / R) (:func:`score_batches`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.artifacts.trace import Trace, read_trace
from eldr_cli.errors import EldrError
from eldr_cli.pipeline import checks
from eldr_cli.pipeline.place import LAYOUTS, check_routing_matches_trace
from eldr_cli.routing import DecodeRouter, load_routing_artifact


def replay_batches(trace: Trace, rows: np.ndarray, router: DecodeRouter, n_decoders: int, batch_size: int,
                   domains=None) -> dict[str, np.ndarray]:
    """Closed-loop decode replay: at most K*B requests in flight over all decoders.

    Requests of ``rows`` arrive in order whenever the pool has room; each is routed by
    ``router.decide(prefill counts, loads, domain)`` with loads = in-flight requests per decoder (as the
    proxy tracks them). Every global step each decoder decodes one token for all its in-flight
    requests (its batch), replaying the request's next recorded decode step. Returns parallel
    int64 arrays ``step``, ``decoder``, ``request`` (trace row), ``request_step`` -- one row per
    (batch, member) -- and ``assigned`` [len(rows)] (decoder of each request); ``drained_step`` is the
    first global step at which no request was left waiting (before it every pool was full: steady state).
    """
    if trace.decode_offsets is None:
        raise ValueError("trace has no per-step decode picks (decode_offsets) to replay")
    n_steps = np.diff(trace.decode_offsets)
    queue = [int(r) for r in rows if n_steps[r] > 0]
    inflight: list[list[list[int]]] = [[] for _ in range(n_decoders)]
    assigned = {}
    cols: dict[str, list[int]] = {"step": [], "decoder": [], "request": [], "request_step": []}
    cap = n_decoders * batch_size
    total, t, qi = 0, 0, 0
    drained = None
    while qi < len(queue) or total:
        while total < cap and qi < len(queue):
            r = queue[qi]
            qi += 1
            loads = [len(x) for x in inflight]
            counts = trace.prefill_counts[r] if router.needs_signature else None
            dec = router.decide(counts, loads, domain=None if domains is None else domains[r], key=r)
            d = dec.worker
            if not 0 <= d < n_decoders:
                raise EldrError(f"routing policy chose decoder {d} of {n_decoders}")
            router.on_dispatch(dec, r)
            inflight[d].append([r, 0])
            assigned[r] = d
            total += 1
        if drained is None and qi >= len(queue):
            drained = t
        for d in range(n_decoders):
            for item in inflight[d]:
                cols["step"].append(t)
                cols["decoder"].append(d)
                cols["request"].append(item[0])
                cols["request_step"].append(item[1])
                item[1] += 1
            done = [x for x in inflight[d] if x[1] >= n_steps[x[0]]]
            if done:
                inflight[d] = [x for x in inflight[d] if x[1] < n_steps[x[0]]]
                total -= len(done)
                for x in done:
                    router.on_finish(d, x[0])
        t += 1
    out = {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}
    out["assigned"] = np.asarray([assigned.get(int(r), -1) for r in rows], dtype=np.int64)
    out["drained_step"] = np.asarray(t if drained is None else drained, dtype=np.int64)
    return out


def score_batches(trace: Trace, rec: dict[str, np.ndarray], layouts: dict[str, np.ndarray], ep_size: int,
                  chunk: int = 512) -> dict[str, np.ndarray]:
    """METRO metric for every batch step. ``layouts``: name -> physical_to_logical [L, P] (shared by
    all decoders) or [K, L, P] (one per decoder). Returns per-batch arrays (means over layers):
    ``active``, ``lower_bound`` and one max-activated-per-rank column per layout, plus ``step``,
    ``decoder``, ``batch_size``."""
    from eldr_cli.method.placement import lower_bound, max_active_per_rank

    if trace.decode_offsets is None or trace.decode_picks is None:
        raise ValueError("trace has no per-step decode picks to score")
    L, E = trace.num_layers, trace.num_experts
    key = rec["step"] * (rec["decoder"].max(initial=0) + 1) + rec["decoder"]
    uniq, batch_of = np.unique(key, return_inverse=True)
    nb = uniq.size
    first = np.zeros(nb, dtype=np.int64)
    first[batch_of[::-1]] = np.arange(len(key))[::-1]
    out = {"step": rec["step"][first], "decoder": rec["decoder"][first],
           "batch_size": np.bincount(batch_of, minlength=nb).astype(np.int64),
           "active": np.zeros(nb), "lower_bound": np.zeros(nb), **{n: np.zeros(nb) for n in layouts}}
    pick_row = trace.decode_offsets[rec["request"]] + rec["request_step"]
    order = np.argsort(batch_of, kind="stable")
    starts = np.searchsorted(batch_of[order], np.arange(0, nb + 1))
    for b0 in range(0, nb, chunk):
        b1 = min(nb, b0 + chunk)
        sel = order[starts[b0]:starts[b1]]
        picks = np.asarray(trace.decode_picks[pick_row[sel]], dtype=np.int64)   # [m, L, k]
        bi = batch_of[sel] - b0
        act = np.zeros((b1 - b0, L, E), dtype=bool)
        act[bi[:, None, None], np.arange(L)[None, :, None], picks] = True
        out["active"][b0:b1] = act.sum(-1).mean(-1)
        out["lower_bound"][b0:b1] = lower_bound(act, ep_size).mean(-1)
        dec = out["decoder"][b0:b1]
        for name, p2l in layouts.items():
            if p2l.ndim == 2:
                out[name][b0:b1] = max_active_per_rank(act, p2l, ep_size).mean(-1)
            else:
                for k in np.unique(dec):
                    m = dec == k
                    out[name][b0:b1][m] = max_active_per_rank(act[m], p2l[k], ep_size).mean(-1)
    return out


def run_evaluate_placement(trace_path, routing_path, placement_path, out, *, batch_size: int = 8,
                           policy: str = "eldr", tau: float | None = None, split: str = "evaluation",
                           seed: int = 0, figures: bool = True) -> Path:
    """Replay held-out decode through the routing policy and score the three layouts (METRO metric)."""
    import polars as pl

    from eldr_cli.routing import RoutingModel, make_router

    checks.check_batch_size(batch_size)
    checks.check_tau(tau)
    trace = read_trace(trace_path, with_picks=True)
    if trace.decode_picks is None:
        raise EldrError(f"trace {trace.path} has no per-step decode picks (decode_picks); evaluation replays them",
                        hint="capture with per-step picks (the default of `eldr capture`)")
    routing = load_routing_artifact(routing_path)
    check_routing_matches_trace(routing, trace)
    plc = Artifact(placement_path, kind="placement")
    K = checks.check_k_matches(routing, plc.params["n_decoders"], what=f"placement {plc.path} n_decoders")
    got = plc.manifest["inputs"].get("routing", {}).get("content_hash")
    if got != routing.content_hash:
        raise EldrError(f"placement {plc.path} was fitted from another routing artifact than {routing.path}",
                        hint="rerun `eldr place-experts` with this routing artifact")
    if (plc.params["num_layers"], plc.params["num_experts"]) != (trace.num_layers, trace.num_experts):
        raise EldrError(f"placement is for L={plc.params['num_layers']}, E={plc.params['num_experts']}; "
                        f"the trace has L={trace.num_layers}, E={trace.num_experts}")
    R = int(plc.params["ep_size"])
    layouts = {"contiguous": plc.array("contiguous_physical_to_logical"),
               "global_eplb": plc.array("global_eplb_physical_to_logical"),
               "per_decoder": plc.array("per_decoder_physical_to_logical")}
    model = RoutingModel.load(routing.path)
    router = make_router(policy, K, model=model, tau=tau, seed=seed)
    rows = np.flatnonzero(trace.split_mask(split))
    domains = trace.column("domain")
    rec = replay_batches(trace, rows, router, K, int(batch_size), domains=domains)
    if rec["step"].size == 0:
        raise EldrError(f"the {split} requests of {trace.path} have no decode steps to replay")
    sc = score_batches(trace, rec, layouts, R)
    generated = trace.model.get("family") == "synthetic" or trace.model.get("model") == "synthetic"
    source = "generated" if generated else ("imported" if trace.model.get("family") == "imported" else "captured")
    lb = float(sc["lower_bound"].mean())
    metrics = {"n_requests": int(rows.size), "n_batch_steps": int(sc["step"].size),
               "n_global_steps": int(sc["step"].max() + 1), "mean_batch_size": float(sc["batch_size"].mean()),
               "mean_active_experts": float(sc["active"].mean()), "mean_lower_bound": lb,
               "mean_max_active_per_rank": {n: float(sc[n].mean()) for n in LAYOUTS},
               "gap_to_lower_bound": {n: float(sc[n].mean() / lb - 1.0) if lb > 0 else 0.0 for n in LAYOUTS},
               "per_decoder_vs_contiguous": float(sc["per_decoder"].mean() / sc["contiguous"].mean() - 1.0),
               "per_decoder_vs_global_eplb": float(sc["per_decoder"].mean() / sc["global_eplb"].mean() - 1.0),
               "requests_per_decoder": np.bincount(rec["assigned"][rec["assigned"] >= 0], minlength=K).tolist(),
               "trace_source": source}
    params = {"policy": policy, "tau": model.tau if tau is None else tau, "batch_size": int(batch_size),
              "split": split, "seed": seed, "ep_size": R, "n_decoders": K,
              "replica_routing": "metro-greedy", "metric": "max activated experts on any EP rank, mean over layers"}
    with ArtifactWriter(out, kind="placement-eval", params=params,
                        inputs={"trace": trace_path, "routing": routing.path, "placement": plc.path}) as w:
        w.write_table("steps", pl.DataFrame({k: sc[k] for k in ("step", "decoder", "batch_size", "active",
                                                                   "lower_bound", *LAYOUTS)}))
        w.write_table("batches", pl.DataFrame({k: rec[k] for k in ("step", "decoder", "request", "request_step")}))
        w.metrics.update(metrics)
        if figures:
            _plot_eval(w.figure_path("placement_eval.png"), sc, R, generated)
    return Path(out)


def _plot_eval(path, sc, R, generated) -> None:
    from eldr_cli import plots

    plt = plots.plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = {"contiguous": "contiguous", "global_eplb": "global EPLB", "per_decoder": "per-decoder"}
    colors = {"contiguous": "tab:grey", "global_eplb": "tab:blue", "per_decoder": "tab:orange"}
    means = [sc[n].mean() for n in LAYOUTS]
    a1.bar(list(names.values()), means, color=[colors[n] for n in LAYOUTS])
    a1.axhline(sc["lower_bound"].mean(), color="k", ls="--", lw=1, label="ceil(active / R)")
    for i, v in enumerate(means):
        a1.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    a1.set_ylabel("max activated experts per rank\n(mean over steps and layers)")
    a1.legend(loc="lower right")
    for n in LAYOUTS:
        x = np.sort(sc[n] - sc["lower_bound"])
        a2.plot(x, np.linspace(0, 1, len(x)), label=names[n], color=colors[n])
    a2.set_xlabel("excess over ceil(active / R) per batch step")
    a2.set_ylabel("CDF")
    a2.legend()
    src = "GENERATED trace" if generated else "captured trace"
    fig.suptitle(f"Replayed decode batches, EP R={R} ({src})")
    plots.save(fig, path)
