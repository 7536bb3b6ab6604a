"""What `make gpu-check` measures of the decode step, as functions without polars or zarr (a GPU machine's bare
``python3`` has torch, numpy and scipy only): the whole step of a model timed kind by kind, the agreement of
two timings of it, the roofline's error against it, and the measured replay of a shipped GENERATED trace."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from eldr_cli.costmodel import decode_step as ds


def whole_step(model: str, tp: int = 1, *, device: str = "cuda", compile: bool = True, shape: dict | None = None,
               batches=ds.DEFAULT_BATCHES, actives=ds.DEFAULT_ACTIVE, contexts=ds.DEFAULT_CONTEXTS,
               repeats: int = 20, kinds=("moe", "dense", "lm_head")) -> dict:
    """Every layer kind of ``model`` (or ``shape``) timed and fitted: {shape, timed, compiled, moe, dense,
    lm_head (each {coefficients_ms, fit, rows}), step_per_moe_layer (the cost model's a, b, c, kv)}."""
    from eldr_cli.costmodel.measured_step import cost_model_of

    shape = dict(shape) if shape is not None else ds.layer_shape(model, tp)
    kw: dict[str, Any] = dict(device=device, compile=compile, repeats=repeats)
    out: dict = {"shape": {k: v for k, v in shape.items() if k != "not_timed"}, "not_timed": shape.get("not_timed")}
    rows, facts = ds.time_decode_step(shape, batches=batches, actives=actives, contexts=contexts, **kw)
    coef, fit, rows = ds.fit_decode_step(rows)
    out.update(timed=facts["timed"], compiled=facts["compiled"], moe={"coefficients_ms": coef, "fit": fit,
                                                                     "rows": rows})
    dense = None
    if "dense" in kinds and shape.get("dense_layers"):
        drows = ds.time_dense_layer(shape, batches=batches, contexts=contexts, **kw)
        dense, dfit, drows = ds.fit_dense_layer(drows)
        out["dense"] = {"coefficients_ms": dense, "fit": dfit, "rows": drows}
    head = {}
    if "lm_head" in kinds and shape.get("vocab"):
        hrows = ds.time_lm_head(shape, batches=batches, **kw)
        head = ds.fit_lm_head(hrows)
        out["lm_head"] = {"coefficients_ms": head, "rows": hrows}
    if "dense" in kinds or not shape.get("dense_layers"):
        cm = cost_model_of(coef, shape, device, head, dense)
        out["step_per_moe_layer"] = {"a": cm.a_ms, "b": cm.b_ms, "c": cm.c_ms, "kv": cm.kv_ms}
    return out


def step_ms_at(whole: dict, row: dict) -> float:
    """The measured whole step (ms) at one MoE-kind point: L_moe x that point + L_dense x the dense layer at
    its (batch, context) (the measured row, else the fit) + the LM head at its batch (fit)."""
    s = whole["shape"]
    ms = s["n_layers"] * row["ms"]
    if s.get("dense_layers"):
        d = whole["dense"]
        hit = [r["ms"] for r in d["rows"] if (r["batch"], r["context"]) == (row["batch"], row["context"])]
        c = d["coefficients_ms"]
        ms += s["dense_layers"] * (hit[0] if hit else c["d0"] + c["dt"] * row["batch"] + c["dv"] * row["kv_tokens"])
    h = (whole.get("lm_head") or {}).get("coefficients_ms") or {}
    return ms + h.get("h0", 0.0) + h.get("h1", 0.0) * row["batch"]


def roofline_whole_step_error(whole: dict, preset: str | None) -> dict:
    """The calibrated roofline's decode step against the measured whole step, per MoE-kind point (roofline /
    measured); {"preset": None} without a device preset."""
    if preset is None:
        return {"preset": None}
    from eldr_cli.costmodel.roofline import build
    from eldr_cli.errors import EldrError

    s = whole["shape"]
    note = ""
    try:
        r = build(s["model"], device=preset, dtype="bf16", tp=s["tp"])[2]
    except EldrError as e:  # Maverick bf16 TP8 does not fit 8 x 80 GB: its roofline times it all the same
        r = build(s["model"], device=preset, dtype="bf16", tp=s["tp"], hbm_gb=1e6)[2]
        note = f"evaluated without the memory check ({e.message})"
    ratios = [r.step_ms(x["active_experts"] * s["n_layers"], [x["context"]] * x["batch"]) / step_ms_at(whole, x)
              for x in whole["moe"]["rows"]]
    return {"preset": preset, "model": s["model"], "tp": s["tp"], "ratio_min_max": [min(ratios), max(ratios)],
            "ratio_median": float(np.median(ratios)), "within_25pct": all(0.75 <= q <= 1.25 for q in ratios),
            "what": f"{s['n_layers']} MoE + {s.get('dense_layers', 0)} dense layers + LM head, measured",
            **({"note": note} if note else {})}


def agreement(a: list[dict], b: list[dict], keys=("batch", "active_experts", "context")) -> dict:
    """Two timings of the same points (rows with ``ms``): b / a per common point, and whether all are within
    10%."""
    at = {tuple(r[k] for k in keys): r["ms"] for r in a}
    ratios = [r["ms"] / at[tuple(r[k] for k in keys)] for r in b if tuple(r[k] for k in keys) in at]
    if not ratios:
        return {"points": 0, "within_10pct": False}
    return {"points": len(ratios), "ratio_min_max": [min(ratios), max(ratios)],
            "ratio_median": float(np.median(ratios)), "within_10pct": all(0.9 <= q <= 1.1 for q in ratios)}


def load_replay_fixture(path) -> tuple[SimpleNamespace, dict]:
    """(a trace-like object with decode_picks, decode_offsets, prompt_tokens, num_layers, num_experts, top_k;
    {(policy, batch size): replay record}) of a fixture written by ``tools/make_replay_fixture.py``."""
    z = np.load(path, allow_pickle=False)
    meta = {k: int(z[k]) for k in ("num_layers", "num_experts", "top_k")}
    trace = SimpleNamespace(decode_picks=z["decode_picks"], decode_offsets=z["decode_offsets"],
                            prompt_tokens=z["prompt_tokens"], **meta)
    recs = {}
    for name in z["policies"].tolist():
        p, b = str(name).rsplit("@", 1)
        recs[(p, int(b))] = {k: z[f"{name}:{k}"].astype(np.int64)
                             for k in ("step", "decoder", "request", "request_step", "drained_step")}
    return trace, recs


def measured_replay(path, shape: dict, *, device: str = "cuda", dtype: str = "bf16", cost=None,
                    max_steps: int = 60, repeats: int = 3, seed: int = 0) -> dict:
    """The fixture's policies' steps run as ``shape``'s MoE layers (:class:`moe_replay.StepTimer`): per
    (policy, batch) the measured MoE ms per step with its interval and ``cost``'s prediction, and each policy
    against the best load balancer."""
    from eldr_cli.simulator.moe_replay import StepTimer, compare, measure_policy

    trace, recs = load_replay_fixture(path)
    timer = StepTimer(shape, trace.num_layers, device=device, dtype=dtype, repeats=repeats, seed=seed)
    results = [{"policy": p, "batch_size": b, "measured": measure_policy(trace, rec, timer, cost=cost,
                                                                         max_steps=max_steps, seed=seed)}
               for (p, b), rec in recs.items()]
    return {"results": results, "vs_best_lb": compare(results), "weight_banks": len(timer.banks),
            "graphs": len(timer.graphs)}
