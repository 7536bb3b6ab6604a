"""`eldr bench replay`: distinct active experts per decode step by routing policy and batch size (the
paper's Fig. 13), from a trace's own per-step decode picks. No clock and no cost model: the number is
a property of the trace and the routing decision alone.

For each policy and batch size B, the served rows (repeated in seeded shuffled passes until there are
at least ``PASSES_MIN x K x B`` requests) go through :func:`eldr_cli.pipeline.evaluate.replay_batches`:
K decoders, at most K x B requests in flight, each routed at admission by the decode router
(``routing.make_router``), the step-cluster ``oracle`` included (``routing.oracle``: balanced clusters fitted
on the *decode* patterns of the served rows themselves, the same band rule) and the ``clairvoyant`` limit row
(``routing.clairvoyant``: eldr-live's rule on each row's true future activations). Every (step, decoder) batch is
scored by the union of its members' current-step picks: distinct active experts per layer (mean over
layers). Only steady-state steps count (while requests were still waiting, so every pool was full).

The summary gives, per batch size, the share of the distance from the best load balancer to the step-cluster
oracle that ELDR covers (ELDR can pass it: it is not a limit), and the clairvoyant router's active experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing import LOAD_BALANCERS, ROUTERS
from eldr_cli.routing.registry import check_policy

REPLAY_POLICIES = ROUTERS
DEFAULT_BATCHES = (1, 4, 16, 64)
COLORS = {"round-robin": "tab:blue", "random": "tab:orange", "jsq": "tab:green", "p2c": "tab:olive",
          "domain": "tab:purple", "eldr": "tab:red", "oracle": "black"}
STYLES: dict[str, dict[str, Any]] = {"eldr": {"lw": 2.2}, "oracle": {"lw": 1.6, "ls": "--"}}
PASSES_MIN = 3  # requests per run >= 3 K B, so the steady state is most of the run


def step_masks(trace, pick_rows: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Packed bit sets (uint64 [n, W]) of the decode steps ``pick_rows`` (bit l*E + e: expert e at layer l)."""
    from eldr_cli.simulator.replay import _pack_bits

    L, E = trace.num_layers, trace.num_experts
    out = []
    for i in range(0, len(pick_rows), chunk):
        picks = np.asarray(trace.decode_picks[pick_rows[i:i + chunk]], dtype=np.int64)  # [c, L, k]
        flat = np.zeros((picks.shape[0], L * E), dtype=bool)
        valid = (picks >= 0) & (picks < E)
        rows = np.broadcast_to(np.arange(picks.shape[0])[:, None, None], picks.shape)
        flat[rows[valid], (np.arange(L)[None, :, None] * E + picks)[valid]] = True
        out.append(_pack_bits(flat))
    return np.vstack(out) if out else np.zeros((0, max(1, (L * E + 63) // 64)), dtype=np.uint64)


class StepMasks:
    """The packed decode-step bit sets of the served rows, built once and shared by every replay run."""

    def __init__(self, trace, rows: np.ndarray):
        off = np.asarray(trace.decode_offsets, dtype=np.int64)
        pick_rows = np.concatenate([np.arange(off[r], off[r + 1]) for r in np.unique(rows)])
        self.index = np.full(int(off[-1]), -1, dtype=np.int64)
        self.index[pick_rows] = np.arange(pick_rows.size)
        self.masks = step_masks(trace, pick_rows)

    def __getitem__(self, pick_rows: np.ndarray) -> np.ndarray:
        return self.masks[self.index[pick_rows]]


def score(trace, rec: dict, masks: StepMasks) -> dict:
    """Mean distinct active experts per layer over the steady-state (step, decoder) batches of ``rec``."""
    steady = rec["step"] < int(rec["drained_step"])
    if not steady.any():  # fewer requests than one full pool: score every step, and say so
        steady = np.ones_like(rec["step"], dtype=bool)
    K = int(rec["decoder"].max(initial=0)) + 1
    key = rec["step"][steady] * K + rec["decoder"][steady]
    pick_rows = np.asarray(trace.decode_offsets, dtype=np.int64)[rec["request"][steady]] + rec["request_step"][steady]
    bits = masks[pick_rows]
    order = np.argsort(key, kind="stable")
    k_sorted = key[order]
    starts = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]])
    union = np.bitwise_or.reduceat(bits[order], starts, axis=0)
    active = np.bitwise_count(union).sum(axis=1) / trace.num_layers
    sizes = np.diff(np.r_[starts, len(k_sorted)])
    return {"mean_active_per_layer": float(active.mean()), "mean_batch": float(sizes.mean()),
            "batch_steps": int(len(starts)), "steady_state": bool((rec["step"] < int(rec["drained_step"])).any())}


def oracle_share(lb: float, eldr: float, oracle: float) -> float | None:
    from eldr_cli.routing.oracle import oracle_share as share

    return share(lb, eldr, oracle)


def shares(results: list[dict]) -> list[dict]:
    """Per batch size: best load balancer, ELDR, the step-cluster oracle and the clairvoyant router (active experts
    per layer), and ELDR's share (%) of the distance to the step-cluster oracle."""
    out = []
    for B in sorted({r["batch_size"] for r in results}):
        at = {r["policy"]: r["mean_active_per_layer"] for r in results if r["batch_size"] == B}
        lbs = {p: at[p] for p in LOAD_BALANCERS if p in at}
        row: dict = {"batch_size": B}
        if lbs:
            best = min(lbs, key=lambda p: lbs[p])
            row.update(best_lb=best, best_lb_active=lbs[best])
            if "eldr" in at and "oracle" in at:
                row.update(eldr_active=at["eldr"], oracle_active=at["oracle"],
                           share_pct=oracle_share(lbs[best], at["eldr"], at["oracle"]))
            if "clairvoyant" in at:
                row["clairvoyant_active"] = at["clairvoyant"]
        out.append(row)
    return out


def run_replay(trace_path, *, routing, policies=None, batch_sizes=DEFAULT_BATCHES, split: str = "evaluation",
               tau: float | None = None, seed: int = 0, progress=None, measure=None) -> dict:
    """Replay every (policy, batch size); returns {"results": [...], "oracle_share": [...], facts}. ``measure``
    (``costmodel.moe_replay.MeasuredReplay``): each result also gets ``measured`` = ``measure(trace, record)``
    (its steps' MoE time, MEASURED), and the result ``measured_vs_best_lb``."""
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.pipeline import checks
    from eldr_cli.pipeline.evaluate import replay_batches
    from eldr_cli.routing import RoutingModel, make_router

    policies = list(policies or [p for p in REPLAY_POLICIES])
    for p in policies:
        check_policy(p)
    sizes = sorted({int(b) for b in batch_sizes})
    for b in sizes:
        checks.check_batch_size(b, flag="--batch-sizes")
    checks.check_tau(tau)
    tr = read_trace(trace_path, with_picks=True)
    if tr.decode_picks is None or tr.decode_offsets is None:
        raise EldrError(f"trace {trace_path} has no per-step decode picks, which replay needs",
                        hint="capture again (`eldr capture --model M --prompts P --max-new-tokens N` records "
                             "per-step picks) or generate with `eldr synth-trace --picks`")
    model = RoutingModel.load(routing)
    if tuple(model.shape) != (tr.num_layers, tr.num_experts):
        raise EldrError(f"the trace has L={tr.num_layers}, E={tr.num_experts} but the routing artifact expects "
                        f"{model.shape[0]}x{model.shape[1]}",
                        hint="fit the routing artifact on a trace of the same model")
    K = int(model.n_clusters)
    served = np.flatnonzero(tr.split_mask(split))
    steps = np.diff(np.asarray(tr.decode_offsets, dtype=np.int64))
    served = served[steps[served] > 0]
    if served.size == 0:
        raise EldrError(f"the {split} rows of {trace_path} have no decode steps to replay")
    domains = tr.column("domain") if "domain" in tr.requests.columns else None
    oracle = None
    if "oracle" in policies or "clairvoyant" in policies:
        from eldr_cli.routing.oracle import fit_oracle

        oracle = fit_oracle(tr.decode_counts, served, K, model=model, tau=tau, seed=seed, decode_steps=tr.decode_steps)

    rng = np.random.default_rng(seed)
    masks = StepMasks(tr, served)
    results = []
    for B in sizes:
        passes = max(1, -(-PASSES_MIN * K * B // served.size))
        rows = np.concatenate([rng.permutation(served) for _ in range(passes)])
        for name in policies:
            router = make_router(name, K, model=model, tau=tau, seed=seed, oracle=oracle)
            rec = replay_batches(tr, rows, router, K, B, domains=domains)
            results.append({"policy": name, "batch_size": B, "requests": int(rows.size), **score(tr, rec, masks)})
            got = measure(tr, rec) if measure is not None else None
            if got is not None:
                results[-1]["measured"] = got
            if progress:
                progress(name, B)
    generated = tr.model.get("family") == "synthetic" or tr.model.get("model") == "synthetic"
    source = "generated" if generated else ("imported" if tr.model.get("family") == "imported" else "captured")
    out = {"results": results, "oracle_share": shares(results), "n_decoders": K, "split": split,
           "served_rows": int(served.size), "n_layers": tr.num_layers, "num_experts": tr.num_experts,
           "tau": model.tau if tau is None else tau, "trace_source": source, "model": tr.model.get("model")}
    if any("measured" in r for r in results):
        from eldr_cli.simulator.moe_replay import compare

        out.update(measured=measure.facts(), measured_vs_best_lb=compare(results))
    return out


def write_replay(out, res: dict, *, trace, routing, seed: int = 0, figures: bool = True) -> Path:
    """The `replay` artifact: replay.json (results + oracle_share) and fig13_replay.png."""
    import polars as pl

    from eldr_cli.artifacts.store import ArtifactWriter

    params = {k: res[k] for k in ("n_decoders", "split", "tau", "trace_source", "model", "n_layers", "num_experts")}
    if "measured" in res:
        params["measured"] = res["measured"]
    params.update(policies=list(dict.fromkeys(r["policy"] for r in res["results"])),
                  batch_sizes=sorted({r["batch_size"] for r in res["results"]}), seed=seed,
                  metric="distinct active experts per layer per decode step (steady state, mean over layers)")
    with ArtifactWriter(out, kind="replay", params=params, inputs={"trace": trace, "routing": routing}) as w:
        w.write_table("results", pl.DataFrame([{k: v for k, v in r.items() if k != "measured"}
                                               for r in res["results"]]))
        w.write_json("replay.json", res)
        w.metrics.update({"served_rows": res["served_rows"], "oracle_share": res["oracle_share"]})
        if "measured" in res:
            w.write_table("moe_time", pl.DataFrame(moe_time_rows(res)))
            w.metrics["measured_vs_best_lb"] = res["measured_vs_best_lb"]
        if figures:
            replay_figure(w.figure_path("fig13_replay.png"), res)
    return Path(out)


def replay_figure(path, res: dict) -> None:
    """Fig. 13 (replay): distinct active experts per layer per decode step against batch size, per policy."""
    from eldr_cli import plots

    plt = plots.plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    pols = list(dict.fromkeys(r["policy"] for r in res["results"]))
    for p in pols:
        rs = sorted((r for r in res["results"] if r["policy"] == p), key=lambda r: r["batch_size"])
        style: dict[str, Any] = STYLES.get(p, {})
        ax.plot([r["batch_size"] for r in rs], [r["mean_active_per_layer"] for r in rs], marker="o", ms=3,
                label=p, color=COLORS.get(p, "tab:gray"), **style)
    ax.axhline(res["num_experts"], color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in res["results"]})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("decode batch size per decoder (closed loop)")
    ax.set_ylabel("distinct active experts per layer\nper decode step (mean)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Trace REPLAY ({res['trace_source']} trace, K={res['n_decoders']} decoders): "
                 "active experts by policy", fontsize=9)
    plots.save(fig, path)


def replay_rows(res: dict) -> tuple[list[str], list[list[str]]]:
    """The Fig. 13 table: one row per policy (active experts per layer per step at each batch size), then
    ELDR's share of the best-load-balancer-to-oracle distance. Shared by the CLI and the report."""
    sizes = sorted({r["batch_size"] for r in res["results"]})
    at = {(r["policy"], r["batch_size"]): r["mean_active_per_layer"] for r in res["results"]}
    head = ["policy"] + [f"B={b}" for b in sizes]
    rows = [[p] + [f"{at[(p, b)]:.2f}" if (p, b) in at else "-" for b in sizes]
            for p in dict.fromkeys(r["policy"] for r in res["results"])]
    share = {s["batch_size"]: s.get("share_pct") for s in res["oracle_share"]}
    if any(v is not None for v in share.values()):
        rows.append(["ELDR share of LB->oracle"] + [f"{share[b]:.0f}%" if share.get(b) is not None else "n/a"
                                                    for b in sizes])
    return head, rows


def print_replay(res: dict, console=None) -> None:
    from eldr_cli.console import console as default
    from eldr_cli.console import table

    con = console or default
    head, rows = replay_rows(res)
    t = table(*head, title=f"distinct active experts per layer per decode step -- trace REPLAY "
                           f"({res['trace_source']}, K={res['n_decoders']}, {res['served_rows']} {res['split']} rows)")
    for r in rows:
        t.add_row(*r)
    con.print(t)


def moe_time_rows(res: dict) -> list[dict]:
    """One row per (policy, batch size) of a measured replay: MoE ms per step (mean, 95% interval), charged
    experts per step, the cost model's prediction, and the difference to the best load balancer."""
    vs = {(d["policy"], d["batch_size"]): d for d in res.get("measured_vs_best_lb", [])}
    out = []
    for r in res["results"]:
        m = r.get("measured")
        if m is None:
            continue
        d = vs.get((r["policy"], r["batch_size"]), {})
        out.append({"policy": r["policy"], "batch_size": r["batch_size"], "steps_timed": m["steps_timed"],
                    "mean_batch": m["mean_batch"], "active_per_step": m["active_per_step"], "moe_ms": m["moe_ms"],
                    "moe_ms_lo": m["moe_ms_ci95"][0], "moe_ms_hi": m["moe_ms_ci95"][1],
                    "pred_step_ms": m.get("pred_step_ms"), "pred_expert_ms": m.get("pred_expert_ms"),
                    "best_lb": d.get("best_lb"), "delta_ms": d.get("delta_ms"),
                    "delta_lo": (d.get("delta_ci95") or [None, None])[0],
                    "delta_hi": (d.get("delta_ci95") or [None, None])[1],
                    "pred_delta_expert_ms": d.get("pred_delta_expert_ms")})
    return out


def print_measured(res: dict, console=None) -> None:
    """The measured replay's table: MoE ms per step per policy, its interval, the cost model's prediction."""
    from eldr_cli.console import console as default
    from eldr_cli.console import table

    con = console or default
    f = res["measured"]
    t = table("policy", "B", "steps", "experts/step", "MoE ms/step [95%]", "vs best LB ms [95%]", "predicted",
              title=f"{f['label']} MoE time per decode step: {f['model']} TP{f['tp']} {f['dtype']} on {f['device']}")
    for r in moe_time_rows(res):
        vs = "-" if r["delta_ms"] is None else f"{r['delta_ms']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]"
        pred = "-" if r["pred_delta_expert_ms"] is None else f"{r['pred_delta_expert_ms']:+.3f}"
        t.add_row(r["policy"], str(r["batch_size"]), str(r["steps_timed"]), f"{r['active_per_step']:.0f}",
                  f"{r['moe_ms']:.3f} [{r['moe_ms_lo']:.3f}, {r['moe_ms_hi']:.3f}]", vs, pred)
    con.print(t)
    con.print(f"timed: {f['timed']}; {f['what']}. 'predicted': the cost model's per-expert term for the same steps, "
              "minus the best load balancer's" if f.get("cost_model") else
              f"timed: {f['timed']}; {f['what']}; no --cost-model: no prediction beside it")
