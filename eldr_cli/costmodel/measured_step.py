"""A measured decode step as a `cost-model` artifact (source ``measured-decode-step``): every layer kind of
the model timed (:mod:`eldr_cli.costmodel.decode_step`) or read from a shipped GPU measurement, fitted per kind
and summed into the simulator's step form, per MoE layer (the trace's layers, L_moe of them)::

    step = L_moe * MoE layer + L_dense * dense layer + LM head
    a  = k0 + (L_dense * d0 + h0) / L_moe        b = kb
    c  = kt + (L_dense * dt + h1) / L_moe        kv = kv_moe + L_dense * dv / L_moe

The artifact lists what was timed (``layer_kinds``) and what was not (``not_timed``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from eldr_cli.costmodel import decode_step as ds
from eldr_cli.errors import EldrError

# shipped measurements (eldr_cli/data/gpu/), by (model, TP, device preset): file, sections, how they were run
GPU_CHECK = {"H100-SXM": "h100_gpu_check.json", "H200": "h200_gpu_check.json"}
GPU_CHECK_PROVENANCE = ("MEASURED 2026-11-27 by `make gpu-check` (eldr c21444d; torch 2.11.0+cu130, triton 3.6.0), "
                        "CUDA-event medians of 20 CUDA-graph replays")
MAVERICK_DENSE = "h200_maverick_tp8_dense_layer.json"
MAVERICK_DENSE_PROVENANCE = ("MEASURED 2026-11-27 on an NVIDIA H200 by shared/data/gpu/dense_check.py (torch "
                             "2.11.0+cu130): eager ops replayed from a CUDA graph, not compiled; the shared expert "
                             "timed alone (its own RMSNorm and residual add included)")
MAVERICK_MOE_NOTE = ("gpu-check's `decode_step_maverick_tp8` section: recorded as compiled, but timed in the process "
                     "whose Qwen3 compiled section had already filled dynamo's cache of the same layer function "
                     "with its 8 shapes (the recompile limit), so every Maverick point ran as eager ops replayed "
                     "from a CUDA graph (fixed cost 138 us per layer against 80 us of a compiled run on the same "
                     "H200): used here as NOT compiled, like the dense layer it is summed with")
SHIPPED: dict[tuple[str, int], dict[str, dict[str, tuple[str, Any]]]] = {
    ("Qwen3-30B-A3B", 1): {p: {"moe": (GPU_CHECK[p], {True: "decode_step_compiled", False: "decode_step"}),
                               "lm_head": (GPU_CHECK[p], "lm_head")} for p in GPU_CHECK},
    ("Llama-4-Maverick", 8): {"H200": {"moe": (GPU_CHECK["H200"], {False: "decode_step_maverick_tp8"}),
                                       "dense": (MAVERICK_DENSE, "dense_layer_ms"),
                                       "shared": (MAVERICK_DENSE, "shared_expert_ms")}},
}
MISSING = {("Llama-4-Maverick", 8, "H100-SXM"): "the dense layers and the shared expert on an H100 (timed only on "
                                                "an H200: h200_maverick_tp8_dense_layer.json)"}


def gpu_preset(gpu_name: str) -> str | None:
    """The device preset of a CUDA device name (H100 -> H100-SXM, H200 -> H200), else None."""
    return "H200" if "H200" in gpu_name else ("H100-SXM" if "H100" in gpu_name else None)


def deployment_params(model: str, preset: str | None, tp: int, dtype: str = "bf16") -> dict:
    """The deployment keys a cost model carries (KV capacity per instance, GPUs, TP, ...) for ``model`` on a
    device preset, as ``eldr bench cost-model`` computes them; {} without a preset (no KV cap, said)."""
    if preset is None:
        return {}
    from eldr_cli.costmodel.deployment import DEPLOYMENT_KEYS
    from eldr_cli.costmodel.roofline import build

    try:
        _, _, _, d = build(model, device=preset, dtype=dtype, tp=tp)
    except EldrError as e:  # e.g. Maverick bf16 at TP8 on 80 GB GPUs: timed per rank, but no such instance
        return {"deployment_note": f"no KV capacity: {e.message}"}
    dep = d.as_params()
    return {**{k: dep[k] for k in DEPLOYMENT_KEYS}, "deployment": dep}


def cost_model_of(coef: dict, shape: dict, device: str, head: dict | None = None, dense: dict | None = None):
    """The measured kinds as one cost model per MoE layer (see the module docstring): the dense layers and
    the LM head spread over the ``n_layers`` MoE layers so that a step charges each once."""
    from eldr_cli.costmodel import CostModel

    L, Ld = shape["n_layers"], int(shape.get("dense_layers") or 0)
    h, d = head or {}, dense or {}
    if Ld and not d:
        raise EldrError(f"{shape['model']} has {Ld} dense layers and none was timed: a step without them is "
                        "half the model")
    return CostModel(a_ms=coef["k0"] + (Ld * d.get("d0", 0.0) + h.get("h0", 0.0)) / L, b_ms=coef["kb"],
                     c_ms=coef["kt"] + (Ld * d.get("dt", 0.0) + h.get("h1", 0.0)) / L,
                     kv_ms=coef["kv"] + Ld * d.get("dv", 0.0) / L,
                     source="measured-decode-step", device=device, top_k=shape["top_k"], model=shape["model"])


def _kinds(shape: dict, fits: dict, timed: str) -> dict:
    """The artifact's ``layer_kinds``: per kind, its layers per step, what one is, its fit and how timed."""
    out = {"moe": {"layers": shape["n_layers"], "fit_ms": fits["moe"], "timed": timed,
                   "shared_experts": int(shape.get("shared_experts") or 0)}}
    if shape.get("dense_layers"):
        out["dense"] = {"layers": shape["dense_layers"], "fit_ms": fits["dense"], "timed": timed,
                        "intermediate": shape["dense_intermediate"]}
    out["lm_head"] = {"layers": 1, "fit_ms": fits.get("head") or "not measured"}
    return out


def write_step(out, kinds: dict, shape: dict, device: str, preset: str | None, params: dict,
               metrics: dict | None = None, not_timed: list | None = None) -> Path:
    """Fit every kind's rows (``kinds``: moe, dense, shared, lm_head -> rows; a kind the model lacks: []) and
    write the sum as a `cost-model` artifact, with the device preset's deployment (none without a preset)."""
    import polars as pl

    from eldr_cli.costmodel import write_cost_model

    coef, fit, rows = ds.fit_decode_step(kinds["moe"])
    tables = {"decode_step_timings": pl.DataFrame(rows)}
    extra = {}
    if kinds.get("shared"):  # a shared expert timed alone joins the MoE layer's fit
        s, sfit, srows = ds.fit_dense_layer(kinds["shared"])
        coef = {**coef, "k0": coef["k0"] + s["d0"], "kt": coef["kt"] + s["dt"], "kv": coef["kv"] + s["dv"]}
        tables["shared_expert_timings"] = pl.DataFrame(srows)
        extra["shared_expert_ms"] = s
    dense: dict | None = None
    dfit: dict = {}
    if kinds.get("dense"):
        dense, dfit, drows = ds.fit_dense_layer(kinds["dense"])
        tables["dense_layer_timings"] = pl.DataFrame(drows)
    head = ds.fit_lm_head(kinds.get("lm_head") or [])
    if kinds.get("lm_head"):
        tables["lm_head_timings"] = pl.DataFrame(kinds["lm_head"])
    cm = cost_model_of(coef, shape, device, head, dense)
    missing = list(not_timed if not_timed is not None else shape.get("not_timed", []))
    if not head and not any("LM head" in x for x in missing):
        missing.insert(0, "the LM head (no vocabulary or not measured): not charged")
    L, Ld = shape["n_layers"], int(shape.get("dense_layers") or 0)
    how = "torch.compile + CUDA graph" if params.get("compiled") and params.get("launch", "graph") == "graph" else (
        "CUDA graph" if params.get("launch") == "graph" or params.get("measured") else "launched eagerly")
    prov = (f"MEASURED decode step: {shape['model']} TP{shape['tp']}, the whole step ({L} MoE layers"
            f"{' with shared expert' if shape.get('shared_experts') else ''}{f' + {Ld} dense layers' if Ld else ''}"
            f"{' + the LM head' if head else '; LM head not measured'}; {how}) on {device}"
            f"{' (shipped with eldr)' if params.get('measured') else ''}")
    return write_cost_model(out, cm, params={"provenance": prov,
        **params, "label": "MEASURED", "layer_ms": coef, "dense_layer_ms": dense or "none (no dense layers)",
        "lm_head_ms": head or "not measured", **extra, "n_layers": L, "dense_layers": Ld,
        "step": f"{L} MoE layers + {Ld} dense layers" + (" + the LM head" if head else " (LM head not charged)")
                + ", per step",
        "layer_kinds": _kinds(shape, {"moe": coef, "dense": dense, "head": head}, params.get("timed", "")),
        "not_timed": missing, **deployment_params(shape["model"], preset, shape["tp"])},
        metrics={**{f"fit_{k}": v for k, v in fit.items()}, **{f"dense_fit_{k}": v for k, v in dfit.items()},
                 **(metrics or {})}, tables=tables)


def shipped_kinds(device: str, model: str = "Qwen3-30B-A3B", tp: int = 1, compiled: bool | None = None,
                  dtype: str | None = None) -> tuple[dict, dict]:
    """(kinds: moe/dense/shared/lm_head -> rows, facts) of the shipped GPU measurement of ``model`` at TP ``tp``
    on a device preset; ``compiled`` None: compiled where shipped. Refuses, naming what is missing, any model,
    TP, device or launch that was not measured whole."""
    from eldr_cli.costmodel.calibration import DATA
    from eldr_cli.costmodel.presets import device_facts, model_config

    preset, _, _, _ = device_facts(device)
    name, _ = model_config(model)
    have = "; ".join(f"{m} TP{t} on {', '.join(v)}" for (m, t), v in SHIPPED.items())
    hint = f"shipped: {have}; or time one on your GPU: eldr bench decode-step --device cuda"
    if dtype not in (None, "bf16", "bfloat16"):
        raise EldrError(f"no shipped {dtype} decode-step measurement: every shipped step is bf16 (the fp8 runs "
                        "timed the expert GEMMs alone: h100_maverick_tp8_rank.json, no attention, dense layer or "
                        "shared expert)", hint=hint)
    src = SHIPPED.get((name, tp), {}).get(preset)
    if src is None:
        why = MISSING.get((name, tp, preset), "a measured step")
        raise EldrError(f"no shipped decode-step measurement of {name} TP{tp} on {preset}: missing {why}", hint=hint)
    moe_file, sections = src["moe"]
    comp = max(sections) if compiled is None else compiled
    if comp not in sections:
        raise EldrError(f"the shipped {name} TP{tp} step on {preset} was not timed "
                        f"{'compiled' if comp else 'uncompiled'}", hint="leave out --compile/--no-compile")
    docs = {f: json.loads((DATA / f).read_text()) for f in {v[0] for v in src.values()}}
    sec = docs[moe_file][sections[comp]]
    keep = ("batch", "active_experts", "context", "kv_tokens", "ms")
    kinds: dict = {"moe": [{k: r[k] for k in keep} for r in sec["rows"]], "dense": [], "shared": [], "lm_head": []}
    for kind in ("dense", "shared"):
        if kind in src:
            f, key = src[kind]
            kinds[kind] = [{"batch": r["batch"], **({"context": r["context"]} if kind == "dense" else {}),
                            "ms": r[key]} for r in docs[f]["rows"]]
    if "lm_head" in src:
        kinds["lm_head"] = docs[src["lm_head"][0]].get("lm_head", {}).get("rows", [])
    shape = ds.layer_shape(name, tp)
    if kinds["moe"] and any(sec["shape"][k] != shape[k] for k in ("hidden", "heads", "kv_heads", "num_experts")):
        raise EldrError(f"the shipped {name} TP{tp} measurement has another shape than the preset's")
    parts = {"moe": f"{moe_file} `{sections[comp]}` ({GPU_CHECK_PROVENANCE})"
                    + (f"; {MAVERICK_MOE_NOTE}" if name == "Llama-4-Maverick" else "")}
    if "dense" in src:
        parts["dense"] = parts["shared"] = f"{MAVERICK_DENSE} ({MAVERICK_DENSE_PROVENANCE})"
    if "lm_head" in src:
        parts["lm_head"] = f"{GPU_CHECK[preset]} `lm_head` (compiled + CUDA graph)"
    return kinds, {"shape": shape, "preset": preset, "gpu": docs[moe_file]["device"], "compiled": comp,
                   "timed": sec["timed"] if comp else sec["timed"].split(";")[0] + ", not compiled",
                   "measured_parts": parts}


def shipped_rows(device: str, model: str = "Qwen3-30B-A3B", tp: int = 1, compiled: bool | None = None):
    """(MoE-layer rows, facts) of a shipped measurement (see :func:`shipped_kinds`)."""
    kinds, facts = shipped_kinds(device, model, tp, compiled)
    return kinds["moe"], facts


def run_decode_step_from_measured(out: str | os.PathLike, *, device: str, model: str = "Qwen3-30B-A3B", tp: int = 1,
                                  compiled: bool | None = None, dtype: str | None = None) -> Path:
    """A `cost-model` artifact from a decode step measured on a GPU and shipped with eldr (no GPU needed)."""
    kinds, f = shipped_kinds(device, model, tp, compiled, dtype)
    shape = f["shape"]
    not_timed = list(shape["not_timed"])
    if not kinds["lm_head"]:
        not_timed.insert(0, f"the LM head: not measured for {shape['model']} TP{tp} (the shipped LM head is "
                            "Qwen3-30B-A3B's), not charged")
    return write_step(out, kinds, shape, f"cuda ({f['gpu']})", f["preset"],
                      {**{k: v for k, v in shape.items() if k != "not_timed"}, "timed": f["timed"],
                       "compiled": f["compiled"], "measured": f"{GPU_CHECK_PROVENANCE} (see measured_parts)",
                       "measured_parts": f["measured_parts"], "measured_file": GPU_CHECK[f["preset"]]},
                      not_timed=not_timed)


def run_decode_step(out: str | os.PathLike, *, model: str = "Qwen3-30B-A3B", tp: int = 1,
                    batches=ds.DEFAULT_BATCHES, actives=ds.DEFAULT_ACTIVE, contexts=ds.DEFAULT_CONTEXTS,
                    device: str = "auto", dtype: str | None = None, backend: str = "auto", launch: str = "auto",
                    repeats: int = 20, seed: int = 0, compile: bool | None = None, shape: dict | None = None,
                    progress=None) -> Path:
    """Time every layer kind, fit and write a `cost-model` artifact (source ``measured-decode-step``).
    ``shape`` overrides the preset's (tests time small layers on a CPU). ``compile`` None: on a GPU (as vLLM
    runs). ``progress(kind, i, n)``."""
    from eldr_cli.costmodel.moe_layer import device_label, resolve_device

    dev = resolve_device(device)
    shape = dict(shape) if shape is not None else ds.layer_shape(model, tp)
    compile = (dev == "cuda") if compile is None else compile
    t0 = time.perf_counter()
    kw: dict[str, Any] = dict(device=dev, dtype=dtype, launch=launch, repeats=repeats, seed=seed, compile=compile)

    def tick(kind):
        return (lambda i, n: progress(kind, i, n)) if progress else None

    rows, facts = ds.time_decode_step(shape, batches=batches, actives=actives, contexts=contexts, backend=backend,
                                      progress=tick("MoE layer"), **kw)
    dense = ds.time_dense_layer(shape, batches=batches, contexts=contexts, progress=tick("dense layer"), **kw)
    head = ds.time_lm_head(shape, batches=batches, **kw)
    preset = None
    if dev == "cuda" and facts["dtype"] == "bfloat16":
        import torch

        preset = gpu_preset(torch.cuda.get_device_name())
    params = {k: v for k, v in facts.items() if k != "not_timed"}
    return write_step(out, {"moe": rows, "dense": dense, "lm_head": head}, shape, device_label(dev), preset,
                      {**params, "batches": list(batches), "actives": list(actives), "contexts": list(contexts),
                       "seed": seed}, metrics={"measure_s": round(time.perf_counter() - t0, 2)})
