"""`eldr bench decode-step`: time every decoder-layer kind of a model's decode step and fit the step form.

A decode step of B requests is the model's L decoder layers and its LM head. Each layer kind the model has
(:mod:`eldr_cli.costmodel.layer_kinds`) is timed, as a serving engine runs it::

    attention block: RMSNorm -> QKV projection -> attention over each request's KV cache (the model's query
                     and KV heads, grouped-query) -> output projection (+ residual)
    MoE layer:   attention block -> RMSNorm -> router GEMM and top-k -> the routed experts over only the
                 distinct experts the batch activates, and the shared expert(s) if any (+ residual)
    dense layer: attention block -> RMSNorm -> dense SwiGLU MLP (+ residual)

the MoE kind at a grid of (batch B, distinct active experts A, context C per request), the dense kind at
(B, C). On a GPU the routed experts are a grouped GEMM over all experts with per-expert row offsets
(``torch._grouped_mm``, bf16) replayed from a CUDA graph, as engines replay decode steps, compiled first by
torch.compile (one graph per shape, any fallback an error: :mod:`eldr_cli.costmodel.compiled`); on a CPU the
per-expert loop, launched eagerly (labelled). The routing of each point is fixed so that exactly A experts
are active (the router GEMM and top-k still run, their ids returned so that a compiler keeps them).

Fits (non-negative least squares, residuals stated per point), per layer of each kind::

    MoE layer   = k0 + kb * A + kt * B + kv * (B * C)
    dense layer = d0 + dt * B + dv * (B * C)
    LM head     = h0 + h1 * B            (once per step)

summed in :mod:`eldr_cli.costmodel.measured_step` into the simulator's step form.
"""

from __future__ import annotations

import time

import numpy as np

from eldr_cli.errors import EldrError

DEFAULT_BATCHES = (8, 64, 256)
DEFAULT_ACTIVE = (8, 32, 64, 128)
DEFAULT_CONTEXTS = (512, 2048, 8192)
MAX_KV_TOKENS = 64 * 8192  # B * C cap per point: the KV cache of one point stays near 1 GB at Qwen3's heads
MOE_COLUMNS = ("k0", "kb", "kt", "kv")
DENSE_COLUMNS = ("d0", "dt", "dv")


def layer_shape(model: str, tp: int = 1) -> dict:
    """One TP rank's shape of a model's layer kinds (:func:`layer_kinds.layer_kinds`) as one flat dict: the
    attention's query heads, KV heads (at least 1: vLLM replicates a KV head when TP exceeds them), the MoE
    layer's experts, expert width / TP, top-k, shared experts, the dense layers' count and width / TP,
    ``n_layers`` = the MoE layers (the trace's layers), ``vocab`` / TP and what is not timed."""
    from eldr_cli.costmodel.layer_kinds import layer_kinds
    from eldr_cli.costmodel.presets import model_config

    k = layer_kinds(*model_config(model), tp)
    moe, dense = k["moe"], k["dense"] or {"layers": 0, "intermediate": 0}
    return {"model": k["model"], "tp": tp, **k["attention"], "num_experts": moe["num_experts"],
            "intermediate": moe["intermediate"], "top_k": moe["top_k"], "n_layers": moe["layers"],
            "shared_experts": moe["shared_experts"], "shared_intermediate": moe["shared_intermediate"],
            "dense_layers": dense["layers"], "dense_intermediate": dense["intermediate"], "vocab": k["vocab"],
            "not_timed": k["not_timed"]}


def grid(batches, actives, contexts, top_k: int, num_experts: int, max_kv_tokens: int = MAX_KV_TOKENS):
    """The timed (batch, active, context) points: A <= min(E, B * top_k), B * C <= ``max_kv_tokens``."""
    return [(b, a, c) for b in batches for c in contexts for a in actives
            if a <= min(num_experts, b * top_k) and b * c <= max_kv_tokens]


def dense_grid(batches, contexts, max_kv_tokens: int = MAX_KV_TOKENS):
    """The timed (batch, context) points of a dense layer: B * C <= ``max_kv_tokens``."""
    return [(b, c) for b in batches for c in contexts if b * c <= max_kv_tokens]


def _rms(x):
    import torch

    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def _swiglu(w, H: int, inter: int):
    """A dense SwiGLU MLP [H] -> 2 x [inter] -> [H] as a function of x (a shared expert, a dense layer)."""
    import torch

    wg, wu, wd = w(H, inter, fan=H), w(H, inter, fan=H), w(inter, H, fan=inter)
    return lambda x: (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd


def _attention_block(shape: dict, w):
    """``attend(x, k_cache, v_cache)``: RMSNorm, QKV, SDPA over the cache (GQA), O projection + residual."""
    import torch

    H, nq, nkv, hd = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    w_qkv, w_o = w(H, (nq + 2 * nkv) * hd, fan=H), w(nq * hd, H, fan=nq * hd)

    def sdpa(q, kc, vc):
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        except (TypeError, RuntimeError):  # a torch without GQA in SDPA: repeat the KV heads
            r = nq // nkv
            return torch.nn.functional.scaled_dot_product_attention(q, kc.repeat_interleave(r, 1),
                                                                    vc.repeat_interleave(r, 1))

    def attend(x, kc, vc):
        B = x.shape[0]
        q = (_rms(x) @ w_qkv)[:, : nq * hd].reshape(B, nq, 1, hd)
        return x + sdpa(q, kc, vc).reshape(B, nq * hd) @ w_o

    return attend


def _decoder_layer(shape: dict, backend: str, w):
    """The MoE decoder layer as ``layer(x, k_cache, v_cache, plan) -> (x, router ids)``, weights drawn by ``w``."""
    import torch

    from eldr_cli.costmodel.moe_layer import moe_form

    E, H, I, k = shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
    attend, w_router = _attention_block(shape, w), w(H, E, fan=H)
    moe = moe_form(w(E, H, I, fan=H), w(E, H, I, fan=H), w(E, I, H, fan=I), I, backend)
    n_shared = int(shape.get("shared_experts") or 0)
    shared = _swiglu(w, H, n_shared * int(shape["shared_intermediate"])) if n_shared else None

    def layer(x, kc, vc, plan):
        x = attend(x, kc, vc)
        h = _rms(x)
        ids = torch.topk(h @ w_router, k, dim=-1).indices  # the router's work; the points' routing is fixed
        y = moe(h, plan)
        return x + (y + shared(h) if shared is not None else y), ids

    return layer


def _dense_layer(shape: dict, w):
    """A dense decoder layer as ``layer(x, k_cache, v_cache) -> x``."""
    attend, mlp = _attention_block(shape, w), _swiglu(w, shape["hidden"], shape["dense_intermediate"])

    def layer(x, kc, vc):
        x = attend(x, kc, vc)
        return x + mlp(_rms(x))

    return layer


def _time_point(fn, args, *, launch: str, compile, timer, repeats: int, what: str) -> float:
    """``fn(*args)`` timed (median ms): through ``compile`` (a :class:`compiled.PerShape` of ``fn``: one whole
    compiled graph per shape, any fallback an EldrError) when given, captured in a CUDA graph or called
    eagerly; timed at once, before a later shape resets dynamo."""
    from eldr_cli.costmodel.moe_layer import _graphed

    def build(run):
        if launch == "graph":
            return _graphed(run, *args)  # its warm-up compiles
        run(*args)  # compiles here
        return lambda: run(*args)

    call = compile.call(args, build, what) if compile else build(fn)
    return timer(call, repeats)


def _compiler(fn, compile: bool):
    from eldr_cli.costmodel.compiled import PerShape

    return PerShape(fn) if compile else None


def _setup(shape: dict, device: str, dtype: str | None, backend: str, launch: str, seed: int):
    """(torch dtype, device, weight drawer, backend, launch, label, dtype name) of a timing run."""
    import torch

    from eldr_cli.costmodel.moe_layer import resolve_backend

    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    backend, launch, how = resolve_backend(backend, launch, device, dtype)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise EldrError(f"unknown --dtype {dtype!r} for the decode step; expected float32 or bfloat16")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # drawn where they live: GBs of KV cache on a GPU

    def w(*s, fan):
        return (torch.randn(*s, generator=g, device=dev, dtype=dt) * fan ** -0.5).to(dt)

    return dt, dev, w, backend, launch, how, dtype


def time_decode_step(shape: dict, *, batches=DEFAULT_BATCHES, actives=DEFAULT_ACTIVE, contexts=DEFAULT_CONTEXTS,
                     device: str = "cpu", dtype: str | None = None, backend: str = "auto", launch: str = "auto",
                     repeats: int = 20, seed: int = 0, max_kv_tokens: int = MAX_KV_TOKENS, compile: bool = False,
                     progress=None) -> tuple[list[dict], dict]:
    """The MoE layer kind: (rows, facts), one row per point {batch, active_experts, context, kv_tokens, ms}
    (median of ``repeats`` timed calls after warm-up; CUDA events on a GPU, the wall clock on a CPU)."""
    import torch

    from eldr_cli.costmodel.moe_layer import _grouped_plan, _routing

    points = grid(batches, actives, contexts, shape["top_k"], shape["num_experts"], max_kv_tokens)
    if len(points) < 4:
        raise EldrError(f"only {len(points)} (batch, active, context) points are timeable (active <= experts "
                        f"and batch * top-k; batch * context <= {max_kv_tokens}); the fit needs at least 4")
    _, dev, w, backend, launch, how, dtype = _setup(shape, device, dtype, backend, launch, seed)
    E, H, k, nkv, hd = shape["num_experts"], shape["hidden"], shape["top_k"], shape["kv_heads"], shape["head_dim"]
    layer = _decoder_layer(shape, backend, w)
    comp = _compiler(layer, compile)
    rng = np.random.default_rng(seed)
    kv: dict = {}
    xs = {b: w(b, H, fan=1) for b in {p[0] for p in points}}
    timer = _cuda_median if dev.type == "cuda" else _wall_median
    rows = []
    with torch.inference_mode():
        for i, (b, a, c) in enumerate(points):
            if (b, c) not in kv:
                kv[(b, c)] = (w(b, nkv, c, hd, fan=1), w(b, nkv, c, hd, fan=1))
            routes = [(e, torch.from_numpy(t).to(dev)) for e, t in _routing(b, a, k, E, rng)]
            plan = _grouped_plan(routes, E, dev) if backend == "grouped" else routes
            ms = _time_point(layer, (xs[b], *kv[(b, c)], plan), launch=launch, compile=comp, timer=timer,
                             repeats=repeats, what=f"the MoE layer at batch {b}, {a} active experts, context {c}")
            rows.append({"batch": b, "active_experts": a, "context": c, "kv_tokens": b * c, "ms": ms})
            if progress:
                progress(i + 1, len(points))
    if compile:
        how += "; compiled by torch.compile (inductor, one whole graph per shape) first"
    shared = f", shared expert(s) {shape['shared_experts']} x {shape['shared_intermediate']}" \
        if shape.get("shared_experts") else ""
    facts = {**shape, "dtype": dtype, "backend": backend, "launch": launch, "timed": how, "repeats": repeats,
             "compiled": bool(compile), "torch": torch.__version__, "device_type": dev.type,
             "layer": "RMSNorm, QKV, attention over the KV cache (GQA, SDPA), O + residual, RMSNorm, router "
                      f"GEMM + top-k, MoE (gate/up, SiLU, down){shared} + residual"}
    return rows, facts


def time_dense_layer(shape: dict, *, batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS, device: str = "cpu",
                     dtype: str | None = None, launch: str = "auto", repeats: int = 20, seed: int = 0,
                     max_kv_tokens: int = MAX_KV_TOKENS, compile: bool = False, progress=None) -> list[dict]:
    """The dense layer kind (attention block + dense MLP): rows {batch, context, kv_tokens, ms}; [] when the
    model has no dense layers."""
    import torch

    if not shape.get("dense_layers"):
        return []
    points = dense_grid(batches, contexts, max_kv_tokens)
    if len(points) < 3:
        raise EldrError(f"only {len(points)} (batch, context) points of the dense layer are timeable (batch * "
                        f"context <= {max_kv_tokens}); its fit needs at least 3")
    _, dev, w, _, launch, _, _ = _setup(shape, device, dtype, "loop", launch, seed + 1)
    layer, nkv, hd = _dense_layer(shape, w), shape["kv_heads"], shape["head_dim"]
    comp = _compiler(layer, compile)
    timer = _cuda_median if dev.type == "cuda" else _wall_median
    rows = []
    with torch.inference_mode():
        for i, (b, c) in enumerate(points):
            args = (w(b, shape["hidden"], fan=1), w(b, nkv, c, hd, fan=1), w(b, nkv, c, hd, fan=1))
            ms = _time_point(layer, args, launch=launch, compile=comp, timer=timer, repeats=repeats,
                             what=f"the dense layer at batch {b}, context {c}")
            rows.append({"batch": b, "context": c, "kv_tokens": b * c, "ms": ms})
            if progress:
                progress(i + 1, len(points))
    return rows


def time_lm_head(shape: dict, *, batches=DEFAULT_BATCHES, device: str = "cpu", dtype: str | None = None,
                 launch: str = "auto", repeats: int = 20, seed: int = 0, compile: bool = False) -> list[dict]:
    """Once per step, after the last layer: the final RMSNorm, the LM head GEMM ([B, H] x [H, vocab / TP]) and
    the greedy pick, at each batch size: rows {batch, ms}. [] when the shape has no vocabulary."""
    import torch

    if not shape.get("vocab"):
        return []
    _, dev, w, _, launch, _, _ = _setup(shape, device, dtype, "loop", launch, seed)
    w_head = w(shape["hidden"], shape["vocab"], fan=shape["hidden"])

    def head(x):
        return torch.argmax(_rms(x) @ w_head, dim=-1)

    timer = _cuda_median if dev.type == "cuda" else _wall_median
    comp = _compiler(head, compile)
    with torch.inference_mode():
        return [{"batch": b, "ms": _time_point(head, (w(b, shape["hidden"], fan=1),), launch=launch,
                                               compile=comp, timer=timer, repeats=repeats,
                                               what=f"the LM head at batch {b}")} for b in batches]


def fit_linear(rows: list[dict], columns: dict) -> tuple[dict, dict, list[dict]]:
    """Non-negative least squares ``ms ~ sum_j coef_j * column_j(row)`` (columns: name -> function of a row),
    the columns scaled so NNLS treats them alike (a KV column is ~1e6 times the others). Returns
    (coefficients in ms, fit summary, rows with ``fit_ms`` and ``rel_residual``)."""
    from scipy.optimize import nnls

    X = np.array([[f(r) for f in columns.values()] for r in rows], dtype=float)
    y = np.array([r["ms"] for r in rows], dtype=float)
    s = np.maximum(np.abs(X).max(axis=0), 1e-12)
    coef, _ = nnls(X / s, y)
    coef = coef / s
    pred = X @ coef
    rel = (pred - y) / np.maximum(y, 1e-12)
    out = [{**r, "fit_ms": float(p), "rel_residual": float(e)} for r, p, e in zip(rows, pred, rel, strict=True)]
    r2 = 1 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    summary = {"r2": r2, "median_abs_rel_error": float(np.median(np.abs(rel))),
               "max_abs_rel_error": float(np.abs(rel).max()), "points": len(rows)}
    return dict(zip(columns, map(float, coef), strict=True)), summary, out


def fit_decode_step(rows: list[dict]) -> tuple[dict, dict, list[dict]]:
    """The MoE layer: ``ms ~ k0 + kb*A + kt*B + kv*(B*C)`` (see :func:`fit_linear`)."""
    return fit_linear(rows, {"k0": lambda r: 1.0, "kb": lambda r: r["active_experts"], "kt": lambda r: r["batch"],
                             "kv": lambda r: r["batch"] * r["context"]})


def fit_dense_layer(rows: list[dict]) -> tuple[dict, dict, list[dict]]:
    """A dense layer: ``ms ~ d0 + dt*B + dv*(B*C)``; a separately timed shared expert (no KV): ``d0 + dt*B``."""
    cols = {"d0": lambda r: 1.0, "dt": lambda r: r["batch"]}
    if any("context" in r for r in rows):
        cols["dv"] = lambda r: r["batch"] * r["context"]
    coef, fit, out = fit_linear(rows, cols)
    return {"dv": 0.0, **coef}, fit, out


def fit_lm_head(rows: list[dict]) -> dict:
    """Non-negative least squares ``ms ~ h0 + h1 * B`` (per step); {} without rows."""
    if not rows:
        return {}
    coef, fit, _ = fit_linear(rows, {"h0": lambda r: 1.0, "h1": lambda r: r["batch"]})
    return {**coef, "max_abs_rel_error": fit["max_abs_rel_error"]}


def _cuda_median(fn, n: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
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
