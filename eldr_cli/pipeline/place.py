"""`eldr place-experts` as an artifact-to-artifact function: fit the placement and export it.

:func:`run_place_experts` reads a trace and the routing artifact fitted on it, fits the per-decoder
placement (ELDR §5), the global EPLB baseline and the contiguous layout
(:mod:`eldr_cli.method.placement`), and writes a ``placement`` artifact with one export per decoder
(``export/decoder-XX.json``) in vLLM's EPLB representation. Its replay evaluation
(``eldr place-experts evaluate``) is :mod:`eldr_cli.pipeline.evaluate`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.artifacts.trace import Trace, read_trace
from eldr_cli.errors import EldrError
from eldr_cli.pipeline import checks
from eldr_cli.routing import load_routing_artifact

LAYOUTS = ("contiguous", "global_eplb", "per_decoder")
EXPORT_FORMAT = "eldr.expert-placement.v1"


# -- inputs ---------------------------------------------------------------------------------------

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

    from eldr_cli.method.placement import (
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
    routing = load_routing_artifact(routing_path)
    check_routing_matches_trace(routing, trace)
    K = checks.check_k_matches(routing, decoders)
    rows, lab = _labelled_rows(trace, routing, K, split)
    L, E = trace.num_layers, trace.num_experts
    dc, steps = trace.decode_counts[rows], trace.decode_steps[rows]

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
        _write_exports(w.path / "export", per.physical_to_logical_, eplb.physical_to_logical_, contiguous,
                       ep_size=ep_size, num_experts=E, moe_layer_ids=moe_ids)
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


def _labelled_rows(trace: Trace, routing: Artifact, K: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``split`` that carry a cluster label in the routing artifact, and their labels."""
    labels = routing.array("labels")
    if labels.shape != (trace.n_requests,):
        raise EldrError(f"routing labels cover {labels.shape[0]} requests, the trace has {trace.n_requests}")
    if labels.max(initial=-1) >= K:
        raise EldrError(f"K mismatch: routing labels name decoder {int(labels.max())} but K={K}")
    rows = np.flatnonzero(trace.split_mask(split) & (labels >= 0))
    if rows.size == 0:
        raise EldrError(f"no {split} requests of {trace.path} carry a cluster label in {routing.path}")
    return rows, labels[rows]


def _write_exports(exp: Path, per_decoder: np.ndarray, global_eplb: np.ndarray, contiguous: np.ndarray, *,
                   ep_size: int, num_experts: int, moe_layer_ids: list) -> None:
    """One vLLM EPLB map per decoder, plus the global EPLB and contiguous layouts, into ``exp``."""
    import json

    exp.mkdir()

    def dump(name, layout, p2l, decoder):
        obj = layout_export(p2l, ep_size=ep_size, num_experts=num_experts, layout=layout, decoder=decoder,
                            moe_layer_ids=moe_layer_ids)
        (exp / name).write_text(json.dumps(obj, separators=(",", ":")) + "\n")

    for k in range(len(per_decoder)):
        dump(f"decoder-{k:02d}.json", "per-decoder", per_decoder[k], k)
    dump("global-eplb.json", "global-eplb", global_eplb, None)
    dump("contiguous.json", "contiguous", contiguous, None)


def _plot_rank_loads(path, per, contiguous, eplb_p2l, R) -> None:
    """Expected activation of each decoder's heaviest rank / mean rank, per layout (box per layout)."""
    from eldr_cli import plots
    from eldr_cli.method.placement import ranks_of

    plt = plots.plt()
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
    plots.save(fig, path)
