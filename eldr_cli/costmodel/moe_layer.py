"""`eldr bench moe-layer`: time one MoE layer on this machine and fit the cost model (ELDR Fig. 2).

The timed layer is a real SwiGLU expert MLP bank (gate/up/down weights [E, H, I] / [E, I, H]) run
with torch over *only the experts the batch activates*: each of the batch's tokens takes top-k
distinct experts from a set of ``active`` experts (spread so every active expert gets tokens), and
the layer does the three matmuls of each active expert over its tokens and scatters the result
back -- the work a grouped MoE kernel does on a memory-bound decode step. The non-MoE part is timed
as one attention block's projections (q, k, v, o: four [H, H] matmuls) plus an RMSNorm.

``device="auto"`` times the CUDA GPU when torch sees one (the same torch ops, timed between
``torch.cuda.synchronize()`` calls), else this CPU; the artifact names the device it timed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.errors import EldrError

DEFAULT_BATCHES = (1, 4, 16, 64, 128)
DEFAULT_ACTIVE = (1, 2, 4, 8, 16, 32, 48, 64)


def _routing(batch: int, active: int, top_k: int, num_experts: int, rng) -> list[tuple[int, np.ndarray]]:
    """(expert, token indices) for a batch whose tokens use exactly ``active`` distinct experts."""
    experts = rng.choice(num_experts, size=active, replace=False)
    k = min(top_k, active)
    slots = (np.arange(batch)[:, None] * k + np.arange(k)[None, :]) % active  # distinct per token
    out = []
    for j in range(active):
        toks = np.flatnonzero((slots == j).any(axis=1))
        if toks.size:
            out.append((int(experts[j]), toks))
    return out


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA GPU, else ``cpu``; ``cuda`` without one is an error."""
    import torch

    if device not in DEVICES:
        raise EldrError(f"unknown --device {device!r}; expected one of {', '.join(DEVICES)}")
    has_cuda = bool(torch.cuda.is_available())
    if device == "cuda" and not has_cuda:
        raise EldrError("--device cuda: torch sees no CUDA GPU on this machine", hint="use --device cpu (or auto)")
    return "cuda" if device == "auto" and has_cuda else ("cpu" if device == "auto" else device)


BACKENDS = ("auto", "grouped", "loop")
FP8 = ("fp8", "float8")  # e4m3 weights and activations, rowwise scales, bf16 out
LAUNCHES = ("auto", "graph", "eager")


def resolve_backend(backend: str, launch: str, device: str, dtype: str) -> tuple[str, str, str]:
    """(backend, launch, label) for a resolved device. ``auto``: on a GPU, a grouped GEMM over all experts
    with per-expert row offsets (``torch._grouped_mm``, what fused MoE kernels run: only active experts'
    weights are read) replayed from a CUDA graph, as engines replay decode steps; on a CPU the per-expert loop,
    eager (no CUDA graphs on a CPU). The eager loop on a GPU is there only on request, labelled launch-bound."""
    import torch

    if backend not in BACKENDS:
        raise EldrError(f"unknown --backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if launch not in LAUNCHES:
        raise EldrError(f"unknown --launch {launch!r}; expected one of {', '.join(LAUNCHES)}")
    gpu = device == "cuda"
    b = backend if backend != "auto" else ("grouped" if gpu else "loop")
    mode = launch if launch != "auto" else ("graph" if gpu else "eager")
    if mode == "graph" and not gpu:
        raise EldrError("--launch graph: CUDA graphs need a CUDA GPU; on a CPU the layer is launched eagerly",
                        hint="use --launch eager (or auto) on a CPU")
    if dtype in FP8:
        if not gpu:
            raise EldrError("--dtype fp8 needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9); "
                            "this run is on a CPU", hint="use --dtype float32 or bfloat16 on a CPU")
        if torch.cuda.get_device_capability() < (9, 0) or not hasattr(torch, "_scaled_grouped_mm"):
            raise EldrError(f"--dtype fp8 on {torch.cuda.get_device_name()} (compute capability "
                            f"{torch.cuda.get_device_capability()}): the fp8 grouped GEMM "
                            f"(torch._scaled_grouped_mm) runs on compute capability >= 9.0 with torch >= 2.8 "
                            f"(this torch {torch.__version__})", hint="use --dtype bfloat16")
        if backend == "loop":
            raise EldrError("--dtype fp8 runs only as the grouped GEMM (torch._scaled_grouped_mm)",
                            hint="use --backend grouped (or auto)")
    if b == "grouped" and dtype not in FP8:
        if not hasattr(torch, "_grouped_mm"):
            raise EldrError(f"--backend grouped needs torch._grouped_mm, which torch {torch.__version__} lacks",
                            hint="use --backend loop, or torch >= 2.8")
        if gpu and (torch.cuda.get_device_capability() < (9, 0) or dtype != "bfloat16"):
            raise EldrError(f"--backend grouped on {torch.cuda.get_device_name()}: torch._grouped_mm runs bf16 on "
                            f"compute capability >= 9.0 (this GPU {torch.cuda.get_device_capability()}, "
                            f"--dtype {dtype})", hint="use --dtype bfloat16 on an H100/H200, or --backend loop")
    what = {"grouped": "grouped GEMM over all experts, per-expert row offsets ("
                       + ("fp8 e4m3, rowwise scales, torch._scaled_grouped_mm)" if dtype in FP8 else
                          "torch._grouped_mm)"),
            "loop": "one matmul chain per active expert"}[b]
    how = {"graph": "replayed from a CUDA graph",
           "eager": "launched eagerly from Python" + (": LAUNCH-BOUND on a GPU (kernel launches, not weight reads)"
                                                      if gpu and b == "loop" else "")}[mode]
    if mode == "eager" and not gpu:
        how += " (CUDA graph capture skipped: no CUDA GPU)"
    return b, mode, f"{what}, {how}"


def _grouped_plan(routes, num_experts: int, dev):
    """(token order [sum of rows], int32 row offsets [E]) of a route list: tokens grouped by expert, every
    expert a group (inactive ones empty), as torch._grouped_mm takes them."""
    import torch

    by = dict(routes)
    order, offs, n = [], [], 0
    for e in range(num_experts):
        idx = by.get(e)
        if idx is not None:
            order.append(idx)
            n += int(idx.numel())
        offs.append(n)
    return torch.cat(order).to(dev), torch.tensor(offs, dtype=torch.int32, device=dev)


def _graphed(fn, *args):
    """``fn(*args)`` captured in a CUDA graph (warmed up on a side stream first); returns its replay."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)

    def replay(_keep=(fn, args)):  # the graph reads its inputs' memory: keep them alive while it can replay
        g.replay()

    return replay


def device_label(device: str) -> str:
    import platform

    if device == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name()})"
    return f"cpu ({platform.processor() or platform.machine()})"


def moe_form(w_gate, w_up, w_down, intermediate: int, backend: str):
    """One SwiGLU MoE layer as a function of (x, plan), for ``bench moe-layer`` and ``bench decode-step``:
    ``grouped`` runs gate and up as one ``[E, H, 2I]`` bank (w13, as fused MoE kernels do) over a (token
    order, row offsets) plan; ``loop`` runs one GEMM chain per active expert over ``[(expert, token indices)]``
    on the separate contiguous gate and up banks (on this project's 2-core CPU, one thread, two contiguous
    GEMMs took 7.8 ms for 16 experts at batch 4 against 9.2 over w13 and 9.5 over its strided halves: the
    bank's layout would be measured, not the weight reads)."""
    import torch

    def moe(x, routes):
        out = torch.zeros_like(x)
        for e, idx in routes:
            xe = x.index_select(0, idx)
            h = torch.nn.functional.silu(xe @ w_gate[e]) * (xe @ w_up[e])
            out.index_add_(0, idx, h @ w_down[e])
        return out

    if backend != "grouped":
        return moe
    w13 = torch.cat([w_gate, w_up], dim=2)

    def moe_grouped(x, plan):
        order, offs = plan
        xs = x.index_select(0, order)
        h13 = torch._grouped_mm(xs, w13, offs=offs)
        h = torch.nn.functional.silu(h13[:, :intermediate]) * h13[:, intermediate:]
        out = torch.zeros_like(x)
        out.index_add_(0, order, torch._grouped_mm(h, w_down, offs=offs))
        return out

    return moe_grouped


def _fp8_grouped(w13, w_down, intermediate: int, dev):
    """The grouped MoE layer in fp8: weights stored [E, N, K] (K contiguous) in e4m3 and passed transposed as
    [E, K, N] to ``torch._scaled_grouped_mm`` with unit rowwise scales; activations cast per call; bf16 out."""
    import torch

    f8 = torch.float8_e4m3fn
    w8 = [w.transpose(1, 2).contiguous().to(f8) for w in (w13, w_down)]
    s8 = [torch.ones(w.shape[0], w.shape[1], device=dev, dtype=torch.float32) for w in w8]

    def moe_fp8(x, plan):
        order, offs = plan
        xs = x.index_select(0, order)
        sa = torch.ones(xs.shape[0], device=dev, dtype=torch.float32)

        def mm(a, i):
            return torch._scaled_grouped_mm(a.to(f8), w8[i].transpose(1, 2), sa, s8[i], offs=offs,
                                            out_dtype=torch.bfloat16)

        h = mm(xs, 0)
        out = torch.zeros_like(x)
        out.index_add_(0, order, mm(torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:], 1))
        return out

    return moe_fp8


def time_moe_layer(*, num_experts: int = 64, hidden: int = 1024, intermediate: int = 512, top_k: int = 8,
                   batches=DEFAULT_BATCHES, actives=DEFAULT_ACTIVE, repeats: int = 7, dtype: str = "float32",
                   threads: int | None = 1, seed: int = 0, device: str = "cpu", backend: str = "auto",
                   launch: str = "auto", progress=None) -> tuple[list[dict], list[dict], dict]:
    """Returns (moe rows, non-moe rows, facts). Each moe row: batch, active_experts, ms (min of repeats).
    ``device``: ``cpu`` or ``cuda`` (see :func:`resolve_device`); ``backend``/``launch`` see
    :func:`resolve_backend`."""
    import torch

    backend, launch, how = resolve_backend(backend, launch, device, dtype)

    if threads:
        torch.set_num_threads(threads)
    fp8 = dtype in FP8
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get("bfloat16" if fp8 else dtype)
    if dt is None:
        raise EldrError(f"unknown --dtype {dtype!r}; expected float32, bfloat16 or fp8")
    if min(num_experts, hidden, intermediate, top_k, repeats) < 1 or top_k > num_experts:
        raise EldrError("experts, hidden, intermediate, top-k and repeats must be >= 1, top-k <= experts")
    dev = torch.device(device)
    # a GPU runs asynchronously: wait for it before reading the clock on either side of a timed call
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(seed)
    scale = hidden ** -0.5
    w_gate = (torch.randn(num_experts, hidden, intermediate, generator=g) * scale).to(dev, dt)
    w_up = (torch.randn(num_experts, hidden, intermediate, generator=g) * scale).to(dev, dt)
    w_down = (torch.randn(num_experts, intermediate, hidden, generator=g) * intermediate ** -0.5).to(dev, dt)
    w_attn = (torch.randn(4, hidden, hidden, generator=g) * scale).to(dev, dt)
    rng = np.random.default_rng(seed)

    layer = _fp8_grouped(torch.cat([w_gate, w_up], dim=2), w_down, intermediate, dev) if fp8 else \
        moe_form(w_gate, w_up, w_down, intermediate, backend)

    def non_moe(x):
        var = x.pow(2).mean(-1, keepdim=True)
        xn = x * torch.rsqrt(var + 1e-6)
        q, k, v = xn @ w_attn[0], xn @ w_attn[1], xn @ w_attn[2]
        return (q + k + v) @ w_attn[3]

    # Each point is timed ``repeats`` times in interleaved, shuffled rounds and the minimum kept: on a
    # shared machine other processes only ever add time, so the minimum is the least biased estimate
    # and a burst of contention cannot hit every repeat of one point.
    points = [(b, a) for b in batches for a in actives if a <= min(num_experts, b * top_k)]
    inputs = {b: torch.randn(b, hidden, generator=g).to(dev, dt) for b in batches}
    # token indices live on the device already, so a timed call copies nothing from the host
    routes = {(b, a): [(e, torch.from_numpy(toks).to(dev)) for e, toks in _routing(b, a, top_k, num_experts, rng)]
              for b, a in points}
    arg = {p: _grouped_plan(routes[p], num_experts, dev) for p in points} if backend == "grouped" else routes
    with torch.inference_mode():
        call = {p: (_graphed(layer, inputs[p[0]], arg[p]) if launch == "graph" else
                    (lambda p=p: layer(inputs[p[0]], arg[p]))) for p in points}
    dense = {b: (lambda b=b: non_moe(inputs[b])) for b in batches}
    best, best_dense = _time_rounds(call, dense, repeats, sync, rng, progress)
    moe_rows = [{"batch": b, "active_experts": a, "ms": best[(b, a)] * 1e3} for b, a in points]
    dense_rows = [{"batch": b, "ms": best_dense[b] * 1e3} for b in batches]
    facts = {"num_experts": num_experts, "hidden": hidden, "intermediate": intermediate, "top_k": top_k,
             "dtype": dtype, "threads": int(torch.get_num_threads()), "repeats": repeats,
             "torch": torch.__version__, "backend": backend, "launch": launch, "timed": how,
             "device_type": dev.type, "launch_bound": bool(dev.type == "cuda" and backend == "loop"
                                                           and launch == "eager")}
    return moe_rows, dense_rows, facts


def _time_rounds(call: dict, dense: dict, repeats: int, sync, rng, progress) -> tuple[dict, dict]:
    """Seconds per point (min over ``repeats`` interleaved, shuffled rounds) of the MoE calls and the dense
    ones: on a shared machine other processes only ever add time, so the minimum is the least biased."""
    import torch

    best = {p: float("inf") for p in call}
    best_dense = {b: float("inf") for b in dense}
    order = list(call)
    with torch.inference_mode():
        for p in order:  # warm-up
            call[p]()
        sync()
        for rep in range(repeats):
            rng.shuffle(order)
            for p in order:
                sync()
                t0 = time.perf_counter()
                call[p]()
                sync()
                best[p] = min(best[p], time.perf_counter() - t0)
            for b, fn in dense.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best_dense[b] = min(best_dense[b], time.perf_counter() - t0)
            if progress:
                progress(rep + 1, repeats)
    return best, best_dense


def fit_cost_model(moe_rows: list[dict], dense_rows: list[dict]) -> tuple[CostModel, dict]:
    """Non-negative least squares: moe ms ~ a + b*active + c*tokens; non-moe ms ~ e + d*tokens."""
    A = np.array([[1.0, r["active_experts"], r["batch"]] for r in moe_rows])
    y = np.array([r["ms"] for r in moe_rows])
    from scipy.optimize import nnls

    # non-negative least squares: a negative intercept would make small steps cost < 0 ms
    coef, _ = nnls(A, y)
    pred = A @ coef
    r2 = 1 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    D = np.array([[1.0, r["batch"]] for r in dense_rows])
    yd = np.array([r["ms"] for r in dense_rows])
    cd, _ = nnls(D, yd)
    model = CostModel(a_ms=float(coef[0]), b_ms=float(coef[1]), c_ms=float(coef[2]),
                      e_ms=float(max(cd[0], 0.0)), d_ms=float(max(cd[1], 0.0)), source="measured")
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    return model, {"r2": r2, "median_abs_rel_error": float(np.median(rel)), "max_abs_rel_error": float(rel.max())}


def run_moe_layer(out: str | os.PathLike, *, num_experts: int = 64, hidden: int = 1024, intermediate: int = 512,
                  top_k: int = 8, batches=DEFAULT_BATCHES, actives=DEFAULT_ACTIVE, repeats: int = 7,
                  dtype: str = "float32", threads: int | None = 1, seed: int = 0, device: str = "auto",
                  backend: str = "auto", launch: str = "auto", progress=None) -> Path:
    import polars as pl

    from eldr_cli import plots

    if not batches or not actives or min(batches) < 1 or min(actives) < 1:
        raise EldrError("batch sizes and active expert counts must be positive integers")
    dev = resolve_device(device)
    t0 = time.perf_counter()
    moe_rows, dense_rows, facts = time_moe_layer(
        num_experts=num_experts, hidden=hidden, intermediate=intermediate, top_k=top_k, batches=batches,
        actives=actives, repeats=repeats, dtype=dtype, threads=threads, seed=seed, device=dev, backend=backend,
        launch=launch, progress=progress)
    if len(moe_rows) < 3:
        raise EldrError("too few (batch, active experts) points to fit the cost model; give more values")
    model, fit = fit_cost_model(moe_rows, dense_rows)
    model = CostModel(**{**model.as_params(), "device": device_label(dev), "top_k": top_k})

    def figures(d: Path):
        plots.moe_layer_cost(d / "fig2_moe_layer.png", moe_rows, model, facts)

    def lookup(b, a):
        return next((r["ms"] for r in moe_rows if r["batch"] == b and r["active_experts"] == a), None)

    metrics = {**{f"fit_{k}": v for k, v in fit.items()}, "points": len(moe_rows),
               "measure_s": round(time.perf_counter() - t0, 2)}
    bmax = max(batches)
    for a in (8, max(a for a in actives if a <= min(num_experts, bmax * top_k))):
        v = lookup(bmax, a)
        if v is not None:
            metrics[f"ms_batch{bmax}_active{a}"] = v
    return write_cost_model(out, model, params={**facts, "batches": list(batches), "actives": list(actives),
                                                "seed": seed},
                            metrics=metrics, tables={"moe_timings": pl.DataFrame(moe_rows),
                                                     "non_moe_timings": pl.DataFrame(dense_rows)},
                            figures=figures)
