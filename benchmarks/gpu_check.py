"""make gpu-check: what eldr's GPU claims rest on, on one CUDA GPU, in one command (target < 3 min).

1. The signature-capture kernels (Triton, compiled) against their torch reference at Qwen3-30B-A3B's shape
   (L=48, E=128, top-8, KV block 16): ``accumulate`` on all 48 layers and ``reduce`` for 256 requests, bit for
   bit; and their cost for 48 layers launched eagerly vs captured in one CUDA graph.
2. ``eldr bench moe-layer`` at Qwen3-30B-A3B's expert shape, bf16 (and fp8 where the GPU runs it): the grouped
   GEMM replayed from a CUDA graph (what serving engines run) and the per-expert loop launched eagerly.
3. Decode attention over a KV cache (32 query / 4 KV heads, dim 128, bf16, SDPA with GQA) in a CUDA graph.
4. ``eldr bench decode-step``'s timing of the WHOLE decode step, kind by kind (MoE layer with its shared
   expert, dense layer, LM head), CUDA graph: Qwen3-30B-A3B TP1 plain and compiled, then one Llama-4-Maverick
   TP8 rank compiled in the same process (where dynamo's recompile limit used to stop compiling silently:
   every shape now gets its own graph or the section fails), and again in a fresh process (as the CLI runs):
   the two must agree within 10%. A forced dynamo fallback must raise.
5. The measured replay (``eldr bench replay --device cuda``) of a GENERATED Maverick-shaped trace shipped with
   the tests (tests/data/replay_maverick_generated.npz): each policy's steps run as Maverick TP8's MoE layers
   (bf16, fp8), MoE ms per step with intervals, against the best load balancer and the measured step's
   prediction.
6. The calibrated roofline of this GPU's preset (H100-SXM or H200) against 2, 3, the Qwen3 layer and the whole
   measured steps (roofline / measured per point).
7. The vLLM plugin's router hook inside CUDA graphs and torch.compile (a toy 48-layer router stack, no vLLM).

No vLLM, no downloads, no polars or zarr (a GPU machine's bare python3 runs it: GPU_PYTHON=python3). Without a
CUDA GPU: one message, exit 2, nothing written; ``--device cpu`` is a DRY RUN of the same code paths at tiny
shapes (CI runs it; no figure of it is a GPU's). MEASURED figures; writes bench-results/gpu_check.json after
every section (a failing one loses nothing) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

L, E, K, BLOCK = 48, 128, 8, 16
QWEN = {"num_experts": 128, "hidden": 2048, "intermediate": 768, "top_k": 8}
FIXTURE = ROOT / "tests" / "data" / "replay_maverick_generated.npz"
CFG = {"device": "cuda"}  # "cpu": the dry run's tiny shapes
TINY_MOE = {"num_experts": 16, "hidden": 64, "intermediate": 32, "top_k": 2}
_ATTN = {"tp": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 128, "not_timed": []}
TINY_QWEN = {**_ATTN, "model": "Qwen3-30B-A3B", "num_experts": 16, "intermediate": 32, "top_k": 2, "n_layers": 4,
             "shared_experts": 0, "shared_intermediate": 0, "dense_layers": 0, "dense_intermediate": 0}
TINY_L4 = {**_ATTN, "tp": 8, "model": "Llama-4-Maverick", "num_experts": 8, "intermediate": 32, "top_k": 1,
           "n_layers": 2, "shared_experts": 1, "shared_intermediate": 32, "dense_layers": 2, "dense_intermediate": 64}


def _events_ms(fn, n: int = 30) -> float:
    """Median CUDA-event time of ``fn()`` over ``n`` calls after 3 warm-ups (``bench decode-step``'s timer)."""
    from eldr_cli.costmodel.decode_step import _cuda_median

    return _cuda_median(fn, n)


def _wall_ms(fn, n: int = 3) -> float:
    from eldr_cli.costmodel.decode_step import _wall_median

    return _wall_median(fn, n)


def _graph(fn):
    from eldr_cli.costmodel.moe_layer import _graphed

    return _graphed(fn)


def kernels() -> dict:
    import torch

    from eldr_cli.kernels import signature_cache as sc_mod

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    out: dict = {"L": L, "E": E, "k": K, "block_size": BLOCK}
    for T in (512, 8192):
        nb = 16384
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev, torch.int32)
        blocks = (torch.arange(T) // BLOCK % nb).to(dev, torch.int32)
        a = sc_mod.SignatureCache.allocate(nb, L, E, BLOCK, K, device=dev)
        ref = a.cache.clone()
        for layer in range(L):
            sc_mod.accumulate(a, ids, blocks, layer, backend="triton")
            sc_mod.accumulate_reference(ref, ids, blocks, layer)
        torch.cuda.synchronize()
        equal = bool(torch.equal(a.cache, ref))

        def all_layers(a=a, ids=ids, blocks=blocks):
            for layer in range(L):
                sc_mod.accumulate(a, ids, blocks, layer, backend="triton")

        eager = _events_ms(all_layers, 10)
        graphed = _events_ms(_graph(all_layers), 10)
        picks = ids[None].expand(L, T, K).contiguous()
        fused = sc_mod.SignatureCache.allocate(nb, L, E, BLOCK, K, device=dev)
        sc_mod.accumulate_all(fused, picks, blocks, backend="triton")
        ref1 = sc_mod.SignatureCache.allocate(nb, L, E, BLOCK, K, device=dev)
        for layer in range(L):
            sc_mod.accumulate_reference(ref1.cache, picks[layer], blocks, layer)
        torch.cuda.synchronize()
        out[f"accumulate_T{T}"] = {"equal_to_reference_all_layers": equal, "eager_48_layers_ms": eager,
                                   "graph_48_layers_ms": graphed, "graph_per_layer_us": graphed / L * 1e3,
                                   "fused_all_layers_equal": bool(torch.equal(fused.cache, ref1.cache)),
                                   "fused_all_layers_eager_ms": _events_ms(
                                       lambda f=fused, p=picks, b=blocks: sc_mod.accumulate_all(f, p, b,
                                                                                               backend="triton"),
                                       10)}
    R, B = 256, 64
    bt = torch.randint(-1, 16384, (R, B), generator=g).to(dev, torch.int32)
    got, fills = sc_mod.reduce(a, bt, backend="triton")
    want, wfills = sc_mod.reduce_reference(a.cache, a.fill, bt)
    out["reduce"] = {"R": R, "max_blocks": B, "equal_to_reference": bool(torch.equal(got, want)
                                                                         and torch.equal(fills, wfills)),
                     "triton_ms": _events_ms(lambda: sc_mod.reduce(a, bt, backend="triton"), 10),
                     "torch_reference_ms": _events_ms(lambda: sc_mod.reduce_reference(a.cache, a.fill, bt), 5)}
    return out


def moe_layer() -> dict:
    from eldr_cli.costmodel.moe_layer import time_moe_layer

    dev = CFG["device"]
    qwen = QWEN if dev == "cuda" else TINY_MOE
    grouped = ("grouped", "graph", (8, 64, 256), (8, 16, 32, 64, 128)) if dev == "cuda" else \
        ("loop", "eager", (2, 8), (2, 4, 8))
    res = {}
    for backend, launch, batches, actives in (grouped, ("loop", "eager", (64,) if dev == "cuda" else (8,), (16, 128)
                                                        if dev == "cuda" else (2, 8))):
        rows, _, facts = time_moe_layer(**qwen, batches=batches, actives=actives, repeats=5 if dev == "cuda" else 1,
                                        dtype="bfloat16" if dev == "cuda" else "float32", threads=None, device=dev,
                                        backend=backend, launch=launch)
        res[f"{backend}_{launch}"] = {"timed": facts["timed"], "launch_bound": facts["launch_bound"], "rows": rows}
    if dev != "cuda":
        return {**res, "grouped_graph_fp8": {"skipped": "dry run: fp8 needs a GPU"}}
    try:
        rows, _, facts = time_moe_layer(**QWEN, batches=(8, 64, 256), actives=(8, 16, 32, 64, 128), repeats=5,
                                        dtype="fp8", threads=None, device="cuda", backend="grouped", launch="graph")
        res["grouped_graph_fp8"] = {"timed": facts["timed"], "launch_bound": False, "rows": rows}
    except Exception as e:  # noqa: BLE001 - recorded: what fp8 does on this GPU is a finding either way
        res["grouped_graph_fp8"] = {"error": repr(e)[:500]}
    return res


def _whole(model: str, tp: int, compile: bool, kinds=("moe", "dense", "lm_head")) -> dict:
    """``bench decode-step``'s timing of every layer kind of ``model`` (a tiny shape in a dry run)."""
    from eldr_cli.simulator.step_check import whole_step

    if CFG["device"] == "cuda":
        return whole_step(model, tp, device="cuda", compile=compile, repeats=20, kinds=kinds)
    shape = TINY_L4 if model.startswith("Llama-4") else TINY_QWEN
    return whole_step(model, tp, device="cpu", compile=False, shape=shape, batches=(2, 4), actives=(1, 2, 4),
                      contexts=(16, 32), repeats=1, kinds=kinds)


def decode_step() -> dict:
    """One whole Qwen3-30B-A3B decoder layer (bf16, grouped GEMM, CUDA graph, not compiled)."""
    return _whole("Qwen3-30B-A3B", 1, False, kinds=("moe",))


def decode_step_compiled() -> dict:
    """The whole Qwen3-30B-A3B step (48 MoE layers + LM head) through torch.compile, one graph per shape."""
    return _whole("Qwen3-30B-A3B", 1, True)


def decode_step_maverick() -> dict:
    """One Llama-4-Maverick TP8 rank's whole step (24 MoE layers with the shared expert, 24 dense layers, LM
    head), compiled, in the process whose Qwen3 sections compiled first (the recompile-limit trap)."""
    return _whole("Llama-4-Maverick", 8, True)


def maverick_fresh_process(doc: dict, out: Path) -> dict:
    """The Maverick MoE layer again in a fresh interpreter (as the CLI runs it): agreement with the in-process
    section within 10% per point."""
    import subprocess

    from eldr_cli.simulator.step_check import agreement

    tmp = out.with_name(out.stem + "_fresh.json")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", "maverick-moe", "--device", CFG["device"],
           "--out", str(tmp)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"fresh process failed ({p.returncode}): {p.stderr[-1500:]}")
    fresh = json.loads(tmp.read_text())["maverick_moe"]
    inproc = doc["decode_step_maverick_tp8"]["moe"]
    return {"fresh_coefficients_ms": fresh["moe"]["coefficients_ms"],
            "in_process_coefficients_ms": inproc["coefficients_ms"],
            "agreement": agreement(inproc["rows"], fresh["moe"]["rows"])}


def compile_fallback_check() -> dict:
    """A function dynamo cannot compile whole must raise, not run uncompiled (decode-step's guard)."""
    import torch

    from eldr_cli.costmodel.compiled import one_graph_per_shape
    from eldr_cli.errors import EldrError

    def breaks(x):
        print("graph break", end="\r")  # dynamo cannot trace print: a graph break
        return x + 1

    try:
        with one_graph_per_shape(breaks, "a function with a graph break") as run:
            run(torch.ones(2, device=CFG["device"]))
    except EldrError as e:
        return {"raised": True, "message": str(e)[:300]}
    return {"raised": False}


def replay_measured(doc: dict) -> dict:
    """The shipped GENERATED trace's policies run as Maverick TP8's MoE layers, bf16 and fp8, with the measured
    whole step of this run as the prediction beside it."""
    from eldr_cli.costmodel.decode_step import layer_shape
    from eldr_cli.costmodel.measured_step import cost_model_of
    from eldr_cli.simulator.step_check import measured_replay

    dev = CFG["device"]
    mav = doc.get("decode_step_maverick_tp8", {})
    shape = layer_shape("Llama-4-Maverick", 8) if dev == "cuda" else \
        {"num_experts": 128, "hidden": 64, "intermediate": 32, "top_k": 1}
    cost = None
    if "moe" in mav:
        cost = cost_model_of(mav["moe"]["coefficients_ms"], {**mav["shape"]}, dev,
                             (mav.get("lm_head") or {}).get("coefficients_ms"),
                             (mav.get("dense") or {}).get("coefficients_ms"))
    res = {"fixture": str(FIXTURE.relative_to(ROOT)), "label": "MEASURED on a GENERATED trace"}
    for dtype, steps in (("bf16", 60), ("fp8", 30)) if dev == "cuda" else (("bf16", 2),):
        t = time.perf_counter()
        try:
            res[dtype] = measured_replay(FIXTURE, shape, device=dev, dtype=dtype, cost=cost, max_steps=steps,
                                         repeats=3 if dev == "cuda" else 1)
        except Exception as e:  # noqa: BLE001 - fp8 may be refused by this GPU: recorded
            res[dtype] = {"error": repr(e)[:500]}
        res[f"{dtype}_s"] = round(time.perf_counter() - t, 1)
    if dev != "cuda":
        res["fp8"] = {"skipped": "dry run: fp8 needs a GPU"}
    return res


def attention() -> list[dict]:
    import torch

    dev = CFG["device"]
    rows = []
    for b in (8, 64, 256) if dev == "cuda" else (2,):
        for c in (512, 2048, 8192) if dev == "cuda" else (16,):
            if b * c > 64 * 8192:
                continue
            q = torch.randn(b, 32, 1, 128, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, 4, c, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)

            def attn(q=q, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            rows.append({"batch": b, "context": c, "kv_bytes": 2 * k.numel() * 2,
                         "graph_ms": _events_ms(_graph(attn)) if dev == "cuda" else _wall_ms(attn)})
    return rows


def _router_stack(st, dev, Hd: int):
    """A toy L-layer router stack whose routers call the plugin's hook (bound per layer as ``bind_model``
    binds it), and a function giving its eager top-k ids [L, T, K] for an input."""
    import functools

    import torch

    class Router(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(Hd, E, device=dev, dtype=torch.bfloat16) / Hd ** 0.5)
            self.mix = torch.nn.Parameter(torch.randn(Hd, Hd, device=dev, dtype=torch.bfloat16) / Hd ** 0.5)
            self.capture_fn = functools.partial(st.capture, i)

        def forward(self, x):
            ids = torch.topk(x @ self.w, K, dim=-1).indices.to(torch.int32)
            self.capture_fn(ids)
            return x + torch.tanh(x @ self.mix), ids

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Router(i) for i in range(L))

        def forward(self, x):
            for r in self.layers:
                x, _ = r(x)
            return x

    model = Stack().eval()

    def eager_ids(x):
        out = []
        with torch.no_grad():
            for r in model.layers:
                x, ids = r(x)
                out.append(ids)
        return torch.stack(out)

    return model, eager_ids


def _graph_trials(model, eager_ids, st, static) -> dict:
    """(a) a CUDA graph, (b) torch.compile then a CUDA graph, (c) torch.compile(mode="reduce-overhead"),
    each replayed on 3 fresh inputs: does the picks buffer equal the eager top-k ids each time?"""
    import torch

    res: dict = {}
    T = static.shape[0]
    for name, fn in (("cuda_graph", model), ("compile_then_cuda_graph", torch.compile(model, dynamic=False)),
                     ("compile_reduce_overhead", torch.compile(model, mode="reduce-overhead", dynamic=False))):
        try:
            with torch.no_grad():
                if name == "compile_reduce_overhead":
                    for _ in range(3):
                        fn(static)
                    run = lambda fn=fn: fn(static)  # noqa: E731
                else:
                    run = _graph(lambda fn=fn: fn(static))
                ok = []
                for _trial in range(3):
                    static.copy_(torch.randn_like(static))
                    st.picks.zero_()
                    run()
                    torch.cuda.synchronize()
                    ok.append(bool(torch.equal(st.picks[:, :T], eager_ids(static.clone()))))
            res[name] = {"picks_equal_eager_on_fresh_inputs": ok}
        except Exception as e:  # noqa: BLE001 - a refusal here is the finding
            res[name] = {"error": repr(e)[:500]}
    return res


def _after_forward(st, dev, T: int, nb: int) -> dict:
    """The after-forward work (begin_forward + one fused accumulate for all layers) on T tokens over
    16-token blocks against the per-layer reference, and its cost eager per layer, fused, and in a graph."""
    import torch

    from eldr_cli.kernels import signature_cache as sc_mod

    res: dict = {}
    st.sc = sc_mod.SignatureCache.allocate(nb, L, E, BLOCK, K, device=dev)
    slots = torch.arange(T, device=dev, dtype=torch.int64) + 16 * 100
    ids = st.picks[:, :T].clone()
    ref = sc_mod.SignatureCache.allocate(nb, L, E, BLOCK, K, device=dev)
    tb = sc_mod.begin_forward(ref, slots, torch.zeros(T, dtype=torch.int64, device=dev))
    for layer in range(L):
        sc_mod.accumulate_reference(ref.cache, ids[layer], tb, layer)
    tb2 = sc_mod.begin_forward(st.sc, slots, st.token_blocks)
    sc_mod.accumulate_all(st.sc, st.picks[:, :T], tb2, backend="triton")
    torch.cuda.synchronize()
    res["after_forward_equal_reference"] = bool(torch.equal(st.sc.cache, ref.cache) and torch.equal(st.sc.fill,
                                                                                                    ref.fill))

    def per_layer():
        t = sc_mod.begin_forward(st.sc, slots, st.token_blocks)
        for layer in range(L):
            sc_mod.accumulate(st.sc, st.picks[layer, :T], t, layer, backend="triton")

    def fused():
        t = sc_mod.begin_forward(st.sc, slots, st.token_blocks)
        sc_mod.accumulate_all(st.sc, st.picks[:, :T], t, backend="triton")

    res["after_forward_eager_per_layer_ms"] = _events_ms(per_layer, 20)
    res["after_forward_eager_fused_ms"] = _events_ms(fused, 20)
    res["after_forward_graph_fused_ms"] = _events_ms(_graph(fused), 20)
    return res


def plugin_graph() -> dict:
    """Issue 29 item 7 without vLLM: the plugin's router hook (``CaptureState.capture``, bound per layer as
    ``bind_model`` binds it) inside a toy 48-layer router stack run (a) captured in a CUDA graph, (b) through
    torch.compile then a CUDA graph, (c) torch.compile(mode="reduce-overhead") (its own CUDA graphs); each
    replayed on fresh inputs: the picks buffer must equal the eager top-k ids. Then the after-forward work
    (begin_forward + one fused accumulate for all layers) against the per-layer reference, and its cost."""
    import torch

    from eldr_cli.vllm_plugin.capture import CaptureState

    dev = torch.device("cuda")
    Hd, T, nb = 512, 256, 4096
    st = CaptureState(layers=L, experts=E, top_k=K, device=dev, bound=True)
    st.picks = torch.zeros(L, T + 64, K, dtype=torch.int32, device=dev)
    st.token_blocks = torch.zeros(T + 64, dtype=torch.int64, device=dev)
    model, eager_ids = _router_stack(st, dev, Hd)
    res: dict = {"layers": L, "tokens": T}
    static = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
    res.update(_graph_trials(model, eager_ids, st, static))
    res.update(_after_forward(st, dev, T, nb))
    return res


def _preset(gpu: str) -> str | None:
    """This GPU's device preset (H100-SXM, H200), or None; a dry run compares against the H200's (meaningless
    numbers, exercised code)."""
    from eldr_cli.costmodel.measured_step import gpu_preset

    return gpu_preset(gpu) if CFG["device"] == "cuda" else "H200"


def roofline_step_error(gpu: str, step: dict) -> dict:
    """The calibrated roofline's Qwen3-30B-A3B decode step / L against the measured MoE layer, per row; and the
    roofline's whole step against the measured whole step (48 layers + the LM head, when measured)."""
    from eldr_cli.costmodel.roofline import build
    from eldr_cli.simulator.step_check import roofline_whole_step_error

    preset = _preset(gpu)
    if preset is None:
        return {"preset": None}
    r = build("Qwen3-30B-A3B", device=preset, dtype="bf16", tp=1)[2]
    Ln = r.facts.n_layers
    ratios = [r.step_ms(x["active_experts"] * Ln, [x["context"]] * x["batch"]) / Ln / x["ms"]
              for x in step["moe"]["rows"]]
    out = {"preset": preset, "step_ratio_min_max": [min(ratios), max(ratios)],
           "within_25pct": all(0.75 <= q <= 1.25 for q in ratios)}
    if "lm_head" in step:
        out["whole_step"] = roofline_whole_step_error(step, preset)
    return out


def roofline_error(gpu: str, moe: dict, attn: list[dict]) -> dict:
    from eldr_cli.costmodel.roofline import build, calibrated

    preset = _preset(gpu)
    if preset is None:
        return {"preset": None, "note": f"no device preset for {gpu}: no roofline to compare"}
    r = build("Qwen3-30B-A3B", device=preset, dtype="bf16", tp=1)[2]
    rows = next(v["rows"] for v in moe.values() if "rows" in v)  # the grouped graph (a dry run: the loop)
    m = [r.moe_layer_ms(x["batch"], x["active_experts"]) / x["ms"] for x in rows if x["batch"] >= 8]
    a = [r.attention_layer_ms(x["batch"], x["context"]) / x["graph_ms"] for x in attn]
    return {"preset": preset, "provenance": calibrated(preset, "Qwen3-30B-A3B", "bf16")[1]["provenance"],
            "moe_ratio_min_max": [min(m), max(m)], "attention_ratio_min_max": [min(a), max(a)],
            "within_15pct": all(0.85 <= x <= 1.15 for x in m + a)}


def sections(gpu: str, doc: dict, out: Path) -> list:
    """(name, function) in the order they run: the decode-step sections before the plugin's, so that a run
    cut short keeps what issue 37 asks for."""
    from eldr_cli.simulator.step_check import roofline_whole_step_error

    gpu_only = CFG["device"] == "cuda"
    return [*((("kernels", kernels),) if gpu_only else ()),
            ("moe_layer", moe_layer), ("decode_attention", attention),
            ("decode_step", decode_step), ("decode_step_compiled", decode_step_compiled),
            ("lm_head", lambda: doc["decode_step_compiled"]["lm_head"]),
            ("decode_step_maverick_tp8", decode_step_maverick),
            ("compile_fallback_check", compile_fallback_check),
            ("replay_measured", lambda: replay_measured(doc)),
            ("roofline", lambda: roofline_error(gpu, doc["moe_layer"], doc["decode_attention"])),
            ("roofline_step", lambda: roofline_step_error(gpu, doc["decode_step"])),
            ("roofline_step_compiled", lambda: roofline_step_error(gpu, doc["decode_step_compiled"])),
            ("roofline_whole_step_maverick_tp8",
             lambda: roofline_whole_step_error(doc["decode_step_maverick_tp8"], _preset(gpu))),
            ("maverick_fresh_process", lambda: maverick_fresh_process(doc, out)),
            *((("plugin_graph", plugin_graph),) if gpu_only else ())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results/gpu_check.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a DRY RUN of the code paths at tiny shapes (no GPU figure)")
    ap.add_argument("--sections", default="", help="comma-separated section names to run (default: all)")
    ap.add_argument("--only", default="", choices=("", "maverick-moe"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    CFG["device"] = args.device
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes on a shared CPU: more threads only contend
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: make gpu-check needs a CUDA GPU, and torch sees none on this machine; nothing written "
              "(--device cpu: a dry run of its code paths at tiny shapes)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    doc: dict = {"label": "MEASURED" if args.device == "cuda" else "DRY RUN on a CPU: tiny shapes, code paths only, "
                 "no figure is a GPU's", "device": gpu, "torch": torch.__version__}
    if args.device == "cuda":
        import triton

        doc["triton"] = triton.__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = [("maverick_moe", lambda: _whole("Llama-4-Maverick", 8, True, kinds=("moe",)))] if args.only else \
        sections(gpu, doc, out)
    want = {x.strip() for x in args.sections.split(",") if x.strip()}
    failed = []
    for name, fn in run:
        if want and name not in want:
            continue
        t = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' figures
            import traceback

            doc[name] = {"error": repr(e)[:500], "traceback": traceback.format_exc()[-3000:]}
            failed.append(name)
        doc[f"{name}_s"] = round(time.perf_counter() - t, 1)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(doc, indent=1))  # after every section: a later failure keeps these
        print(f"[{doc['wall_s']:.0f} s] {name}: {'ERROR ' + doc[name]['error'] if name in failed else 'ok'}",
              flush=True)
    if not args.only:
        try:
            _table(doc)
        except Exception as e:  # noqa: BLE001
            print(f"(table failed: {e!r}; the JSON has every section)")
        doc["checks_failed"] = checks(doc)
        out.write_text(json.dumps(doc, indent=1))
        for c in doc["checks_failed"]:
            print(f"CHECK FAILED: {c}", file=sys.stderr)
    print(f"-> {out}")
    return 1 if failed or doc.get("checks_failed") else 0


def checks(doc: dict) -> list[str]:
    """What must hold for the figures to be defended (issue 37): a forced dynamo fallback raised, the compiled
    sections compiled, and the Maverick MoE layer agrees within 10% in and out of the process (a GPU only)."""
    out = []
    if doc.get("compile_fallback_check", {}).get("raised") is False:
        out.append("a function dynamo cannot compile whole ran without an error")
    if CFG["device"] != "cuda":
        return out
    for key in ("decode_step_compiled", "decode_step_maverick_tp8"):
        if doc.get(key, {}).get("compiled") is False:
            out.append(f"{key} was not compiled")
    ag = doc.get("maverick_fresh_process", {}).get("agreement")
    if ag is not None and not ag.get("within_10pct"):
        out.append(f"the Maverick MoE layer in a fresh process is not within 10% of the in-process one: {ag}")
    return out


def _fmt_whole(key: str, w: dict) -> list[str]:
    """The table lines of a whole-step section: each kind's fit, then the step per MoE layer."""
    if "moe" not in w:
        return [f"  {key}: {w.get('error', w)}"]
    c, f, s = w["moe"]["coefficients_ms"], w["moe"]["fit"], w["shape"]
    out = [f"  {key} ({s['model']} TP{s['tp']}, {'compiled' if w['compiled'] else 'not compiled'}): MoE layer "
           f"x{s['n_layers']} {c['k0'] * 1e3:.1f} us + {c['kb'] * 1e3:.2f} us*active + {c['kt'] * 1e3:.3f} us*batch "
           f"+ {c['kv'] * 1e6:.3f} ns*KV token ({f['points']} points, median |res| "
           f"{100 * f['median_abs_rel_error']:.1f}%)"]
    if "dense" in w:
        d = w["dense"]["coefficients_ms"]
        out.append(f"    dense layer x{s['dense_layers']}: {d['d0'] * 1e3:.1f} us + {d['dt'] * 1e3:.3f} us*batch + "
                   f"{d['dv'] * 1e6:.3f} ns*KV token")
    if "lm_head" in w:
        h = w["lm_head"]["coefficients_ms"]
        out.append(f"    LM head x1: {h['h0'] * 1e3:.1f} us + {h['h1'] * 1e3:.3f} us*batch")
    if "step_per_moe_layer" in w:
        p = w["step_per_moe_layer"]
        out.append(f"    whole step per MoE layer: {p['a'] * 1e3:.1f} us + {p['b'] * 1e3:.2f} us*active + "
                   f"{p['c'] * 1e3:.3f} us*batch + {p['kv'] * 1e6:.3f} ns*KV token")
    return out


def _table(doc: dict) -> None:
    m, r = doc.get("moe_layer", {}), doc.get("roofline", {})
    print(f"gpu-check ({doc['label']}) on {doc['device']}, torch {doc['torch']}; {doc['wall_s']} s")
    k = doc.get("kernels", {})
    for t in ("accumulate_T512", "accumulate_T8192"):
        if t in k:
            x = k[t]
            print(f"  {t}: equal {x['equal_to_reference_all_layers']}, 48 layers eager "
                  f"{x['eager_48_layers_ms']:.3f} ms, graph {x['graph_48_layers_ms']:.3f} ms")
    for name, v in m.items():
        if "rows" in v:
            pts = ", ".join(f"b{x['batch']}/a{x['active_experts']} {x['ms']:.3f}" for x in v["rows"])
            print(f"  moe-layer {name}{' (LAUNCH-BOUND)' if v['launch_bound'] else ''}: {pts} ms"[:200])
    for key in ("decode_step", "decode_step_compiled", "decode_step_maverick_tp8"):
        print("\n".join(_fmt_whole(key, doc.get(key, {}))))
    fb = doc.get("compile_fallback_check", {})
    print(f"  a forced dynamo fallback raised: {fb.get('raised')}")
    ag = doc.get("maverick_fresh_process", {}).get("agreement", {})
    if ag.get("points"):
        print(f"  Maverick MoE layer, fresh process / in process: {ag['ratio_min_max'][0]:.3f}-"
              f"{ag['ratio_min_max'][1]:.3f} over {ag['points']} points (within 10%: {ag['within_10pct']})")
    for dtype in ("bf16", "fp8"):
        rep = doc.get("replay_measured", {}).get(dtype, {})
        for x in rep.get("vs_best_lb", []):
            print(f"  replay {dtype} B={x['batch_size']} {x['policy']}: MoE {x['delta_ms']:+.3f} ms/step vs "
                  f"{x['best_lb']} [{x['delta_ci95'][0]:+.3f}, {x['delta_ci95'][1]:+.3f}]"
                  + (f"; predicted {x['pred_delta_expert_ms']:+.3f}" if "pred_delta_expert_ms" in x else ""))
    for key in ("roofline_step", "roofline_step_compiled"):
        rs = doc.get(key, {})
        if rs.get("preset"):
            w = (rs.get("whole_step") or {}).get("ratio_min_max")
            print(f"  {key}: roofline {rs['preset']} step / L vs measured layer: {rs['step_ratio_min_max'][0]:.2f}-"
                  f"{rs['step_ratio_min_max'][1]:.2f}" + (f"; whole step: {w[0]:.2f}-{w[1]:.2f}" if w else ""))
    rw = doc.get("roofline_whole_step_maverick_tp8", {})
    if rw.get("preset"):
        print(f"  roofline {rw['preset']} / measured whole step, Maverick TP8: {rw['ratio_min_max'][0]:.2f}-"
              f"{rw['ratio_min_max'][1]:.2f} (median {rw['ratio_median']:.2f})")
    pg = doc.get("plugin_graph", {})
    for k_ in ("cuda_graph", "compile_then_cuda_graph", "compile_reduce_overhead"):
        if k_ in pg:
            print(f"  plugin hook {k_}: {pg[k_]}")
    if r.get("preset"):
        print(f"  roofline {r['preset']}: MoE {r['moe_ratio_min_max'][0]:.2f}-{r['moe_ratio_min_max'][1]:.2f}, "
              f"attention {r['attention_ratio_min_max'][0]:.2f}-{r['attention_ratio_min_max'][1]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
