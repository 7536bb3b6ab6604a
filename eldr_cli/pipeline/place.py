"""`eldr place-experts` as artifact-to-artifact functions: fit the placement, export it, replay it.

- :func:`run_place_experts` reads a trace and the routing artifact fitted on it, fits the per-decoder
  placement (ELDR §5), the global EPLB baseline and the contiguous layout
  (:mod:`eldr_cli.stages.placement`), and writes a ``placement`` artifact with one export per
  decoder (``export/decoder-XX.json``) in vLLM's EPLB representation;
- :func:`run_evaluate_placement` replays the trace's held-out decode steps: each request is routed to
  a decoder by the shared routing policy (:func:`eldr_cli.stages.routing.make_policy`), decoders
  run continuous decode batches, and every batch step is scored by the METRO metric (max activated
  experts on any EP rank) for the three layouts, against the bound ceil(active / R).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.artifacts.trace import Trace, read_trace
from eldr_cli.errors import EldrError
from eldr_cli.pipeline import checks

LAYOUTS = ("contiguous", "global_eplb", "per_decoder")
EXPORT_FORMAT = "eldr.expert-placement.v1"


# -- inputs ---------------------------------------------------------------------------------------

def load_routing(routing_path) -> Artifact:
    """The routing artifact (a ``fit`` directory is accepted: its ``routing`` sub-artifact)."""
    art = Artifact(routing_path, kind=("routing", "fit"))
    if art.kind == "fit":
        art = Artifact(Path(routing_path) / "routing", kind="routing")
    return art


def check_routing_matches_trace(routing: Artifact, trace: Trace) -> None:
    checks.check_same_trace(routing, trace, "routing artifact")
    checks.check_same_model_shape(routing, trace, "routing artifact")


# -- export in vLLM's EPLB representation -----------------------------------------------------------

def layout_export(physical_to_logical: np.ndarray, *, ep_size: int, num_experts: int, layout: str,
                  decoder: int | None, moe_layer_ids) -> dict:
    """One decoder's layout in the fields of vLLM's ``EplbModelState`` (vllm/distributed/eplb).

    ``physical_to_logical_map`` [L][P]: logical expert of physical slot p, which lives on EP rank
    p // (P / R) -- what ``AbstractEplbPolicy.rebalance_experts`` returns and EPLB holds;
    ``logical_to_physical_map`` [L][E][max replicas] (-1 padded) and ``logical_replica_count``
    [L][E] are its inverse; without replicas, ``expert_map`` [R][L][E] is each rank's
    global -> local expert index (-1 = not on this rank), like ``FusedMoE.expert_map``.
    """
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    L, P = p2l.shape
    cap = P // ep_size
    count = np.zeros((L, num_experts), dtype=np.int64)
    for l in range(L):
        count[l] = np.bincount(p2l[l], minlength=num_experts)
    maxrep = int(count.max())
    l2p = np.full((L, num_experts, maxrep), -1, dtype=np.int64)
    fill = np.zeros((L, num_experts), dtype=np.int64)
    for l in range(L):
        for p in range(P):
            e = p2l[l, p]
            l2p[l, e, fill[l, e]] = p
            fill[l, e] += 1
    out = {
        "format": EXPORT_FORMAT,
        "layout": layout,
        "decoder": decoder,
        "ep_size": ep_size,
        "num_layers": L,
        "num_logical_experts": num_experts,
        "num_physical_experts": P,
        "num_redundant_experts": P - num_experts,
        "experts_per_rank": cap,
        "moe_layer_ids": list(moe_layer_ids),
        "physical_to_logical_map": p2l.tolist(),
        "logical_to_physical_map": l2p.tolist(),
        "logical_replica_count": count.tolist(),
    }
    if P == num_experts:
        expert_map = np.full((ep_size, L, num_experts), -1, dtype=np.int64)
        for r in range(ep_size):
            expert_map[r, np.arange(L)[:, None], p2l[:, r * cap:(r + 1) * cap]] = np.arange(cap)[None, :]
        out["expert_map"] = expert_map.tolist()
    return out


# -- place-experts ---------------------------------------------------------------------------------

def run_place_experts(trace_path: str | os.PathLike, routing_path: str | os.PathLike, out: str | os.PathLike, *,
                      ep_size: int, batch_size: int | None = None, redundant_experts: int = 0,
                      decoders: int | None = None, split: str = "calibration", figures: bool = True) -> Path:
    """Fit per-decoder placement + global EPLB + contiguous on the calibration split; write ``placement``."""
    import time

    from eldr_cli.stages.placement import (
        GlobalEPLB,
        PerDecoderPlacement,
        check_ep_size,
        contiguous_layout,
        expected_max_rank_share,
    )

    trace = read_trace(trace_path, with_picks=False)
    check_ep_size(trace.num_experts, ep_size)
    check_ep_size(trace.num_experts, ep_size, redundant_experts)
    checks.check_batch_size(batch_size)
    routing = load_routing(routing_path)
    check_routing_matches_trace(routing, trace)
    K = checks.check_k_matches(routing, decoders)
    labels = routing.array("labels")
    if labels.shape != (trace.n_requests,):
        raise EldrError(f"routing labels cover {labels.shape[0]} requests, the trace has {trace.n_requests}")
    if labels.max(initial=-1) >= K:
        raise EldrError(f"K mismatch: routing labels name decoder {int(labels.max())} but K={K}")
    rows = np.flatnonzero(trace.split_mask(split) & (labels >= 0))
    if rows.size == 0:
        raise EldrError(f"no {split} requests of {trace.path} carry a cluster label in {routing.path}")
    L, E = trace.num_layers, trace.num_experts
    dc, steps, lab = trace.decode_counts[rows], trace.decode_steps[rows], labels[rows]

    t0 = time.perf_counter()
    per = PerDecoderPlacement(ep_size=ep_size, batch_size=batch_size).fit(dc, steps, lab, K)
    place_s = time.perf_counter() - t0
    # EPLB balances tokens: its load is each expert's decode token count over all traffic (no B)
    token_load = dc.astype(np.float64).sum(axis=0)
    t0 = time.perf_counter()
    eplb = GlobalEPLB(ep_size=ep_size, n_redundant=redundant_experts).fit(token_load)
    eplb_s = time.perf_counter() - t0
    contiguous = contiguous_layout(L, E, ep_size)

    # how evenly each layout spreads every decoder's own expected activation (1.0 = perfectly even)
    share = {"per_decoder": expected_max_rank_share(per.activation_, per.physical_to_logical_, ep_size),
             "contiguous": expected_max_rank_share(per.activation_, contiguous, ep_size)}
    if redundant_experts == 0:
        share["global_eplb"] = expected_max_rank_share(per.activation_, eplb.physical_to_logical_, ep_size)
    moe_ids = trace.model.get("moe_layer_ids", list(range(L)))
    params = {"ep_size": ep_size, "n_decoders": K, "batch_size": batch_size,
              "redundant_experts": redundant_experts, "num_layers": L, "num_experts": E,
              "experts_per_rank": E // ep_size, "physical_experts_global_eplb": E + redundant_experts,
              "activation": "1-(1-p)^B" if batch_size else "p (decode tokens per step)",
              "eplb_load": "decode tokens of all calibration traffic", "split": split,
              "model": trace.model.get("model"), "moe_layer_ids": list(moe_ids)}
    with ArtifactWriter(out, kind="placement", params=params,
                        inputs={"trace": trace_path, "routing": routing.path}) as w:
        w.write_array("per_decoder_physical_to_logical", per.physical_to_logical_)
        w.write_array("per_decoder_rank", per.rank_)
        w.write_array("per_decoder_activation", per.activation_)
        w.write_array("global_eplb_physical_to_logical", eplb.physical_to_logical_)
        w.write_array("global_eplb_replicas", eplb.replicas_)
        w.write_array("global_eplb_load", eplb.load_)
        w.write_array("contiguous_physical_to_logical", contiguous)
        exp = w.path / "export"
        exp.mkdir()
        import json

        def dump(name, obj):
            (exp / name).write_text(json.dumps(obj, separators=(",", ":")) + "\n")

        for k in range(K):
            dump(f"decoder-{k:02d}.json", layout_export(per.physical_to_logical_[k], ep_size=ep_size, num_experts=E,
                                                        layout="per-decoder", decoder=k, moe_layer_ids=moe_ids))
        dump("global-eplb.json", layout_export(eplb.physical_to_logical_, ep_size=ep_size, num_experts=E,
                                               layout="global-eplb", decoder=None, moe_layer_ids=moe_ids))
        dump("contiguous.json", layout_export(contiguous, ep_size=ep_size, num_experts=E, layout="contiguous",
                                              decoder=None, moe_layer_ids=moe_ids))
        w.metrics.update({"place_s": round(place_s, 4), "eplb_s": round(eplb_s, 4),
                          "n_calibration_requests": int(rows.size),
                          "cluster_sizes": np.bincount(lab, minlength=K).tolist(),
                          "empty_decoders": per.empty_decoders_,
                          "expected_max_rank_share": share,
                          "eplb_replicated_experts": int((eplb.replicas_ > 1).sum())})
        if figures:
            _plot_rank_loads(w.figure_path("placement_rank_load.png"), per, contiguous,
                             eplb.physical_to_logical_ if redundant_experts == 0 else None, ep_size)
    return Path(out)


def _plot_rank_loads(path, per, contiguous, eplb_p2l, R) -> None:
    """Expected activation of each decoder's heaviest rank / mean rank, per layout (box per layout)."""
    from eldr_cli import plots
    from eldr_cli.stages.placement import ranks_of

    plt = plots._plt()
    a = per.activation_
    data, names = [], []
    for name, p2l in (("contiguous", contiguous), ("global EPLB", eplb_p2l), ("per-decoder", per.physical_to_logical_)):
        if p2l is None:
            continue
        rank = ranks_of(np.broadcast_to(p2l, a.shape), R)
        per_rank = np.einsum("kle,kler->klr", a, np.eye(R)[rank])
        tot = per_rank.sum(-1)
        ok = tot > 0
        data.append((per_rank.max(-1)[ok] / (tot[ok] / R)).ravel())
        names.append(name)
    fig, ax = plt.subplots(figsize=(5.5, 3))
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("heaviest rank / mean rank\n(expected activation)")
    ax.set_title(f"Expected EP-rank balance per (decoder, layer), R={R}")
    plots._save(fig, path)


# -- evaluate by replay ------------------------------------------------------------------------------

def replay_batches(trace: Trace, rows: np.ndarray, policy, signature_of, n_decoders: int, batch_size: int,
                   domains=None) -> dict[str, np.ndarray]:
    """Closed-loop decode replay: at most K*B requests in flight over all decoders.

    Requests of ``rows`` arrive in order whenever the pool has room; each is routed by
    ``policy.choose(loads, signature, domain)`` with loads = in-flight requests per decoder (as the
    proxy tracks them). Every global step each decoder decodes one token for all its in-flight
    requests (its batch), replaying the request's next recorded decode step. Returns parallel
    int64 arrays ``step``, ``decoder``, ``request`` (trace row), ``request_step`` -- one row per
    (batch, member) -- and ``assigned`` [len(rows)] (decoder of each request).
    """
    offsets = trace.decode_offsets
    n_steps = np.diff(offsets)
    queue = [int(r) for r in rows if n_steps[r] > 0]
    inflight: list[list[list[int]]] = [[] for _ in range(n_decoders)]
    assigned = {}
    cols: dict[str, list[int]] = {"step": [], "decoder": [], "request": [], "request_step": []}
    cap = n_decoders * batch_size
    total, t, qi = 0, 0, 0
    while qi < len(queue) or total:
        while total < cap and qi < len(queue):
            r = queue[qi]
            qi += 1
            loads = [len(x) for x in inflight]
            d = policy.choose(loads, signature=signature_of(r),
                              domain=None if domains is None else domains[r])
            if not 0 <= d < n_decoders:
                raise EldrError(f"routing policy chose decoder {d} of {n_decoders}")
            inflight[d].append([r, 0])
            assigned[r] = d
            total += 1
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
        t += 1
    out = {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}
    out["assigned"] = np.asarray([assigned.get(int(r), -1) for r in rows], dtype=np.int64)
    return out


def score_batches(trace: Trace, rec: dict[str, np.ndarray], layouts: dict[str, np.ndarray], ep_size: int,
                  chunk: int = 512) -> dict[str, np.ndarray]:
    """METRO metric for every batch step. ``layouts``: name -> physical_to_logical [L, P] (shared by
    all decoders) or [K, L, P] (one per decoder). Returns per-batch arrays (means over layers):
    ``active``, ``lower_bound`` and one max-activated-per-rank column per layout, plus ``step``,
    ``decoder``, ``batch_size``."""
    from eldr_cli.stages.placement import lower_bound, max_active_per_rank

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

    from eldr_cli.stages.routing import RoutingModel, make_policy

    checks.check_batch_size(batch_size)
    checks.check_tau(tau)
    trace = read_trace(trace_path, with_picks=True)
    if trace.decode_picks is None:
        raise EldrError(f"trace {trace.path} has no per-step decode picks (decode_picks); evaluation replays them",
                        hint="capture with per-step picks (the default of `eldr capture`)")
    routing = load_routing(routing_path)
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
    pol = make_policy(policy, K, model=model, tau=tau, seed=seed)
    rows = np.flatnonzero(trace.split_mask(split))
    sig_cache: dict[int, np.ndarray] = {}

    def signature_of(r: int):
        if not getattr(pol, "needs_signature", False):
            return None
        if r not in sig_cache:
            sig_cache[r] = model.signature(trace.prefill_counts[r])
        return sig_cache[r]

    domains = trace.column("domain")
    rec = replay_batches(trace, rows, pol, signature_of, K, int(batch_size), domains=domains)
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

    plt = plots._plt()
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
    plots._save(fig, path)
