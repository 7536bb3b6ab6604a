"""`eldr bench decode-step`: time one whole decoder layer of a decode step and fit the simulator's step form.

A decode step of B requests is L decoder layers; one layer is, as a serving engine runs it::

    RMSNorm -> QKV projection -> attention over each request's KV cache (the model's query and KV heads,
    grouped-query) -> output projection (+ residual) -> RMSNorm -> router GEMM and top-k -> the MoE layer
    over only the distinct experts the batch activates (+ residual)

timed at a grid of (batch B, distinct active experts A, context C per request). On a GPU the layer is a
grouped GEMM over all experts with per-expert row offsets (``torch._grouped_mm``, bf16) replayed from a
CUDA graph, as engines replay decode steps; on a CPU the per-expert loop, launched eagerly (labelled).
The routing of each point is fixed so that exactly A experts are active (the router GEMM and top-k still
run, their result unused), so A is the measured variable, not a random outcome.

The fit is the simulator's step form (``costmodel.step_ms_from_terms``) per layer::

    layer_ms = k0 + kb * A + kt * B + kv * (B * C)          (non-negative least squares)

so a step over L layers is ``L*k0 + kb * sum_l A_l + L*kt*B + L*kv*sum(context)``, plus the LM head once
per step (final RMSNorm, the [B, H] x [H, vocab] GEMM, the greedy pick: ``h0 + h1*B``, timed alike): the
cost model's ``a`` (k0 + h0/L), ``b`` (kb), ``c`` (kt + h1/L) and ``kv`` coefficients. Residuals are stated
per point. The artifact records the model, device, dtype, backend and launch, and is usable wherever a cost model is
(``eldr bench simulate``, ``eldr report``, ``eldr serve-proxy --cost-model``); it is refused for a trace of
another model (experts or top-k differ).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

DEFAULT_BATCHES = (8, 64, 256)
DEFAULT_ACTIVE = (8, 32, 64, 128)
DEFAULT_CONTEXTS = (512, 2048, 8192)
MAX_KV_TOKENS = 64 * 8192  # B * C cap per point: the KV cache of one point stays near 1 GB at Qwen3's heads


def layer_shape(model: str, tp: int = 1) -> dict:
    """One decoder layer's shape of a preset model (``eldr_cli.costmodel.presets.MODELS``) as one TP rank
    holds it: query heads, KV heads (at least 1: vLLM replicates a KV head when TP exceeds them) and each
    expert's intermediate size divided by ``tp``; experts, hidden size and top-k whole."""
    from eldr_cli.costmodel.presets import model_config

    name, cfg = model_config(model)
    if "q_lora_rank" in cfg:
        raise EldrError(f"{name} uses MLA attention, which the timed decoder layer (grouped-query attention) "
                        "does not model", hint="time a GQA model (Qwen3-30B-A3B, Llama-4-Maverick, ...)")
    if tp < 1:
        raise EldrError("--tp must be >= 1")
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"])
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        hidden, top_k = int(cfg["hidden_size"]), int(cfg["num_experts_per_tok"])
        from eldr_cli.costmodel.roofline import model_facts

        n_layers = int(model_facts(cfg).moe_layers)  # a step is n_layers of the timed layer: the MoE layers
    except (KeyError, TypeError, ValueError) as e:
        raise EldrError(f"--model {model}: not an MoE config with heads, experts and top-k ({e!r} missing)") from None
    if heads % tp or inter % tp:
        raise EldrError(f"--tp {tp} does not divide {name}'s {heads} query heads and expert width {inter}")
    return {"model": name, "tp": tp, "hidden": hidden, "heads": heads // tp, "kv_heads": max(1, kv // tp),
            "head_dim": int(cfg.get("head_dim") or hidden // heads), "num_experts": experts,
            "intermediate": inter // tp, "top_k": top_k, "n_layers": n_layers,
            "vocab": int(cfg.get("vocab_size") or 0) // tp}


def grid(batches, actives, contexts, top_k: int, num_experts: int, max_kv_tokens: int = MAX_KV_TOKENS):
    """The timed (batch, active, context) points: A <= min(E, B * top_k), B * C <= ``max_kv_tokens``."""
    return [(b, a, c) for b in batches for c in contexts for a in actives
            if a <= min(num_experts, b * top_k) and b * c <= max_kv_tokens]


def _decoder_layer(shape: dict, backend: str, w):
    """One decoder layer as a function ``layer(x, k_cache, v_cache, plan)``, its weights drawn by ``w``."""
    import torch

    from eldr_cli.costmodel.moe_layer import moe_form

    E, H, I, k = shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
    nq, nkv, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
    w_qkv, w_o, w_router = w(H, (nq + 2 * nkv) * hd, fan=H), w(nq * hd, H, fan=nq * hd), w(H, E, fan=H)
    moe = moe_form(w(E, H, I, fan=H), w(E, H, I, fan=H), w(E, I, H, fan=I), I, backend)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def attention(q, kc, vc):
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        except (TypeError, RuntimeError):  # a torch without GQA in SDPA: repeat the KV heads
            r = nq // nkv
            return torch.nn.functional.scaled_dot_product_attention(q, kc.repeat_interleave(r, 1),
                                                                    vc.repeat_interleave(r, 1))


    def layer(x, kc, vc, plan):
        B = x.shape[0]
        qkv = rms(x) @ w_qkv
        q = qkv[:, : nq * hd].reshape(B, nq, 1, hd)
        x = x + attention(q, kc, vc).reshape(B, nq * hd) @ w_o
        h = rms(x)
        torch.topk(h @ w_router, k, dim=-1)  # the router's work; the points' routing is fixed (see above)
        return x + moe(h, plan)

    return layer


def time_decode_step(shape: dict, *, batches=DEFAULT_BATCHES, actives=DEFAULT_ACTIVE, contexts=DEFAULT_CONTEXTS,
                     device: str = "cpu", dtype: str | None = None, backend: str = "auto", launch: str = "auto",
                     repeats: int = 20, seed: int = 0, max_kv_tokens: int = MAX_KV_TOKENS, compile: bool = False,
                     progress=None) -> tuple[list[dict], dict]:
    """(rows, facts): one row per point {batch, active_experts, context, kv_tokens, ms} (median of
    ``repeats`` timed calls after warm-up; CUDA events on a GPU, the wall clock on a CPU). ``compile``: the
    layer through ``torch.compile`` (inductor fuses the norms, SiLU-and-mul and residual adds, as vLLM
    compiles its models) before the CUDA graph captures it; else the layer's torch ops as they are."""
    import torch

    from eldr_cli.costmodel.moe_layer import _graphed, _grouped_plan, _routing, resolve_backend

    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    backend, launch, how = resolve_backend(backend, launch, device, dtype)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise EldrError(f"unknown --dtype {dtype!r} for the decode step; expected float32 or bfloat16")
    points = grid(batches, actives, contexts, shape["top_k"], shape["num_experts"], max_kv_tokens)
    if len(points) < 4:
        raise EldrError(f"only {len(points)} (batch, active, context) points are timeable (active <= experts "
                        f"and batch * top-k; batch * context <= {max_kv_tokens}); the fit needs at least 4")
    dev = torch.device(device)
    E, H, k, nkv, hd = shape["num_experts"], shape["hidden"], shape["top_k"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device=dev).manual_seed(seed)  # drawn where they live: GBs of KV cache on a GPU

    def w(*s, fan):
        return (torch.randn(*s, generator=g, device=dev, dtype=dt) * fan ** -0.5).to(dt)

    layer = _decoder_layer(shape, backend, w)
    rng = np.random.default_rng(seed)
    run = torch.compile(layer, dynamic=False) if compile else layer
    kv = {}
    for b, _, c in points:
        if (b, c) not in kv:
            kv[(b, c)] = (w(b, nkv, c, hd, fan=1), w(b, nkv, c, hd, fan=1))
    xs = {b: w(b, H, fan=1) for b in {p[0] for p in points}}
    calls = {}
    with torch.inference_mode():
        for b, a, c in points:
            routes = [(e, torch.from_numpy(t).to(dev)) for e, t in _routing(b, a, k, E, rng)]
            plan = _grouped_plan(routes, E, dev) if backend == "grouped" else routes
            args = (xs[b], *kv[(b, c)], plan)
            calls[(b, a, c)] = _graphed(run, *args) if launch == "graph" else (lambda args=args: run(*args))
    timer = _cuda_median if dev.type == "cuda" else _wall_median
    rows = []
    with torch.inference_mode():
        for i, (b, a, c) in enumerate(points):
            rows.append({"batch": b, "active_experts": a, "context": c, "kv_tokens": b * c,
                         "ms": timer(calls[(b, a, c)], repeats)})
            if progress:
                progress(i + 1, len(points))
    if compile:
        how += "; the layer compiled by torch.compile (inductor) first"
    facts = {**shape, "dtype": dtype, "backend": backend, "launch": launch, "timed": how, "repeats": repeats,
             "compiled": bool(compile),
             "torch": torch.__version__, "device_type": dev.type,
             "layer": "RMSNorm, QKV, attention over the KV cache (GQA, SDPA), O + residual, RMSNorm, router "
                      "GEMM + top-k, MoE (gate/up, SiLU, down) + residual"}
    return rows, facts


def time_lm_head(shape: dict, *, batches=DEFAULT_BATCHES, device: str = "cpu", dtype: str | None = None,
                 launch: str = "auto", repeats: int = 20, seed: int = 0, compile: bool = False) -> list[dict]:
    """Once per step, after the last layer: the final RMSNorm, the LM head GEMM ([B, H] x [H, vocab / TP]) and
    the greedy pick, at each batch size: rows {batch, ms}. [] when the shape has no vocabulary."""
    import torch

    from eldr_cli.costmodel.moe_layer import _graphed, resolve_backend

    if not shape.get("vocab"):
        return []
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    _, launch, _ = resolve_backend("loop", launch, device, "float32")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    H, V = shape["hidden"], shape["vocab"]
    w_head = (torch.randn(H, V, generator=g, device=dev, dtype=dt) * H ** -0.5).to(dt)

    def head(x):
        xn = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return torch.argmax(xn @ w_head, dim=-1)

    run = torch.compile(head, dynamic=False) if compile else head
    timer = _cuda_median if dev.type == "cuda" else _wall_median
    rows = []
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, H, generator=g, device=dev, dtype=dt)
            call = _graphed(run, x) if launch == "graph" else (lambda x=x: run(x))
            rows.append({"batch": b, "ms": timer(call, repeats)})
    return rows


def fit_lm_head(rows: list[dict]) -> dict:
    """Non-negative least squares ``ms ~ h0 + h1 * B`` (per step); {} without rows."""
    if not rows:
        return {}
    from scipy.optimize import nnls

    X = np.array([[1.0, r["batch"]] for r in rows])
    y = np.array([r["ms"] for r in rows])
    coef, _ = nnls(X, y)
    rel = (X @ coef - y) / np.maximum(y, 1e-12)
    return {"h0": float(coef[0]), "h1": float(coef[1]), "max_abs_rel_error": float(np.abs(rel).max())}


def _cuda_median(fn, n: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return float(np.median(out))


def _wall_median(fn, n: int) -> float:
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(out))


def fit_decode_step(rows: list[dict]) -> tuple[dict, dict, list[dict]]:
    """Non-negative least squares ``ms ~ k0 + kb*A + kt*B + kv*(B*C)`` over the rows. Returns (coefficients
    {k0, kb, kt, kv} in ms, fit summary, rows with ``fit_ms`` and ``rel_residual``)."""
    from scipy.optimize import nnls

    X = np.array([[1.0, r["active_experts"], r["batch"], r["batch"] * r["context"]] for r in rows])
    y = np.array([r["ms"] for r in rows])
    # scale the columns so NNLS treats them alike (kv's column is ~1e6 times the others)
    s = np.maximum(np.abs(X).max(axis=0), 1e-12)
    coef, _ = nnls(X / s, y)
    coef = coef / s
    pred = X @ coef
    rel = (pred - y) / np.maximum(y, 1e-12)
    out = [{**r, "fit_ms": float(p), "rel_residual": float(e)} for r, p, e in zip(rows, pred, rel, strict=True)]
    r2 = 1 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    summary = {"r2": r2, "median_abs_rel_error": float(np.median(np.abs(rel))),
               "max_abs_rel_error": float(np.abs(rel).max()), "points": len(rows)}
    return dict(zip(("k0", "kb", "kt", "kv"), map(float, coef), strict=True)), summary, out


def cost_model_of(coef: dict, shape: dict, device: str, head: dict | None = None):
    """The measured layer as a cost model; the LM head (once per step: ``h0 + h1*B``) spread over the
    ``n_layers`` layers, so that ``step = L*(k0 + h0/L) + ... + L*(kt + h1/L)*B`` charges it once."""
    from eldr_cli.costmodel import CostModel

    L = shape["n_layers"]
    h0, h1 = (head or {}).get("h0", 0.0), (head or {}).get("h1", 0.0)
    return CostModel(a_ms=coef["k0"] + h0 / L, b_ms=coef["kb"], c_ms=coef["kt"] + h1 / L, kv_ms=coef["kv"],
                     source="measured-decode-step", device=device, top_k=shape["top_k"], model=shape["model"])


# shipped `make gpu-check` measurements (eldr_cli/data/gpu/) with the measured whole decode layer, by device preset
MEASURED_FILES = {"H100-SXM": "h100_gpu_check.json", "H200": "h200_gpu_check.json"}
MEASURED_PROVENANCE = ("MEASURED 2026-11-27 by `make gpu-check` (eldr c21444d; torch 2.11.0+cu130, triton 3.6.0), "
                       "CUDA-event medians of 20 CUDA-graph replays")
# (model, tp) -> gpu_check section of a whole decoder layer; compiled (torch.compile + CUDA graph) first
MEASURED_LAYERS = {("Qwen3-30B-A3B", 1): {True: "decode_step_compiled", False: "decode_step"}}


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

    _, _, _, d = build(model, device=preset, dtype=dtype, tp=tp)
    dep = d.as_params()
    return {**{k: dep[k] for k in DEPLOYMENT_KEYS}, "deployment": dep}


def shipped_rows(device: str, model: str = "Qwen3-30B-A3B", tp: int = 1, compiled: bool = True) -> tuple[list, dict]:
    """(rows, section) of the shipped measured decode layer of ``model`` at TP ``tp`` on a device preset."""
    import json

    from eldr_cli.costmodel.calibration import DATA
    from eldr_cli.costmodel.presets import device_facts, model_config

    preset, _, _, _ = device_facts(device)
    name, _ = model_config(model)
    if preset not in MEASURED_FILES or (name, tp) not in MEASURED_LAYERS:
        have = ", ".join(f"{m} TP{t}" for m, t in MEASURED_LAYERS)
        raise EldrError(f"no shipped decode-step measurement of {name} TP{tp} on {preset}",
                        hint=f"shipped: {have} on {', '.join(MEASURED_FILES)}; or time one on your GPU: "
                             "eldr bench decode-step --device cuda")
    doc = json.loads((DATA / MEASURED_FILES[preset]).read_text())
    sec = {**doc[MEASURED_LAYERS[(name, tp)][compiled]], "lm_head": doc.get("lm_head", {}).get("rows", [])}
    return [{k: r[k] for k in ("batch", "active_experts", "context", "kv_tokens", "ms")} for r in sec["rows"]], \
        {**sec, "gpu": doc["device"], "preset": preset}


def _write(out, rows: list[dict], head_rows: list[dict], shape: dict, device: str, preset: str | None,
           params: dict, metrics: dict | None = None) -> Path:
    """Fit the layer and the LM head, and write them as a `cost-model` artifact (source
    ``measured-decode-step``) with the device preset's deployment (none without a preset: no KV cap)."""
    import polars as pl

    from eldr_cli.costmodel import write_cost_model

    coef, fit, rows = fit_decode_step(rows)
    head = fit_lm_head(head_rows)
    tables = {"decode_step_timings": pl.DataFrame(rows)}
    if head_rows:
        tables["lm_head_timings"] = pl.DataFrame(head_rows)
    return write_cost_model(out, cost_model_of(coef, shape, device, head), params={
        **params, "label": "MEASURED", "layer_ms": coef, "lm_head_ms": head or "not measured (no vocabulary)",
        **deployment_params(shape["model"], preset, shape["tp"])},
        metrics={**{f"fit_{k}": v for k, v in fit.items()}, **(metrics or {})}, tables=tables)


def run_decode_step_from_measured(out: str | os.PathLike, *, device: str, model: str = "Qwen3-30B-A3B", tp: int = 1,
                                  compiled: bool = True) -> Path:
    """A `cost-model` artifact from a decode layer measured on a GPU and shipped with eldr (no GPU needed)."""
    rows, sec = shipped_rows(device, model, tp, compiled)
    return _write(out, rows, sec["lm_head"], sec["shape"], f"cuda ({sec['gpu']})", sec["preset"],
                  {**sec["shape"], "timed": sec["timed"], "compiled": compiled, "measured": MEASURED_PROVENANCE,
                   "measured_file": MEASURED_FILES[sec["preset"]]})


def run_decode_step(out: str | os.PathLike, *, model: str = "Qwen3-30B-A3B", tp: int = 1, batches=DEFAULT_BATCHES,
                    actives=DEFAULT_ACTIVE, contexts=DEFAULT_CONTEXTS, device: str = "auto", dtype: str | None = None,
                    backend: str = "auto", launch: str = "auto", repeats: int = 20, seed: int = 0,
                    compile: bool | None = None, shape: dict | None = None, progress=None) -> Path:
    """Time, fit and write a `cost-model` artifact (source ``measured-decode-step``). ``shape`` overrides
    the preset's layer shape (tests time a small layer on a CPU). ``compile`` None: on a GPU (as vLLM runs)."""
    from eldr_cli.costmodel.moe_layer import device_label, resolve_device

    dev = resolve_device(device)
    shape = dict(shape) if shape is not None else layer_shape(model, tp)
    compile = (dev == "cuda") if compile is None else compile
    t0 = time.perf_counter()
    rows, facts = time_decode_step(shape, batches=batches, actives=actives, contexts=contexts, device=dev,
                                   dtype=dtype, backend=backend, launch=launch, repeats=repeats, seed=seed,
                                   compile=compile, progress=progress)
    head_rows = time_lm_head(shape, batches=batches, device=dev, dtype=dtype, launch=launch, repeats=repeats,
                             seed=seed, compile=compile)
    preset = None
    if dev == "cuda" and facts["dtype"] == "bfloat16":
        import torch

        preset = gpu_preset(torch.cuda.get_device_name())
    return _write(out, rows, head_rows, shape, device_label(dev), preset,
                  {**facts, "batches": list(batches), "actives": list(actives), "contexts": list(contexts),
                   "seed": seed}, metrics={"measure_s": round(time.perf_counter() - t0, 2)})
