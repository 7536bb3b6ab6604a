"""make gpu-check: what eldr's GPU claims rest on, on one CUDA GPU, in one command (target < 3 min).

1. The signature-capture kernels (Triton, compiled) against their torch reference at Qwen3-30B-A3B's shape
   (L=48, E=128, top-8, KV block 16): ``accumulate`` on all 48 layers and ``reduce`` for 256 requests, bit for
   bit; and their cost for 48 layers launched eagerly vs captured in one CUDA graph.
2. ``eldr bench moe-layer`` at Qwen3-30B-A3B's expert shape, bf16: the grouped GEMM replayed from a CUDA graph
   (what serving engines run) and the per-expert loop launched eagerly (launch-bound), same points.
3. Decode attention over a KV cache (32 query / 4 KV heads, dim 128, bf16, SDPA with GQA) in a CUDA graph.
4. The calibrated roofline of this GPU's preset (H100-SXM or H200; any other: said, no roofline error) against
   2 and 3: roofline / measured per row.

No vLLM, no downloads. Without a CUDA GPU: one message, exit 2, nothing written. MEASURED figures; writes
bench-results/gpu_check.json (after every section, so a failing one loses nothing) and prints one table.
5. fp8 (e4m3, rowwise scales, ``torch._scaled_grouped_mm``) for 2 where the GPU runs it.
6. The measured whole decode step (``eldr bench decode-step``'s timing: one decoder layer at (batch, active
   experts, context), CUDA graph) at Qwen3-30B-A3B's shape and one Llama-4-Maverick TP8 rank's, fitted to the
   simulator's step form; the calibrated roofline's step / L against it.
7. The vLLM plugin's router hook inside CUDA graphs and torch.compile (a toy 48-layer router stack, no
   vLLM) and the after-forward accumulation in one launch.
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


def _events_ms(fn, n: int = 30) -> float:
    """Median CUDA-event time of ``fn()`` over ``n`` calls after 3 warm-ups (``bench decode-step``'s timer)."""
    from eldr_cli.costmodel.decode_step import _cuda_median

    return _cuda_median(fn, n)


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

    res = {}
    for backend, launch, batches, actives in (("grouped", "graph", (8, 64, 256), (8, 16, 32, 64, 128)),
                                              ("loop", "eager", (64,), (16, 128))):
        rows, _, facts = time_moe_layer(**QWEN, batches=batches, actives=actives, repeats=5, dtype="bfloat16",
                                        threads=None, device="cuda", backend=backend, launch=launch)
        res[f"{backend}_{launch}"] = {"timed": facts["timed"], "launch_bound": facts["launch_bound"], "rows": rows}
    try:
        rows, _, facts = time_moe_layer(**QWEN, batches=(8, 64, 256), actives=(8, 16, 32, 64, 128), repeats=5,
                                        dtype="fp8", threads=None, device="cuda", backend="grouped", launch="graph")
        res["grouped_graph_fp8"] = {"timed": facts["timed"], "launch_bound": False, "rows": rows}
    except Exception as e:  # noqa: BLE001 - recorded: what fp8 does on this GPU is a finding either way
        res["grouped_graph_fp8"] = {"error": repr(e)[:500]}
    return res


def decode_step() -> dict:
    """Issue 29 item 2: one whole Qwen3-30B-A3B decoder layer (bf16, grouped GEMM, CUDA graph) at (batch,
    active experts, context), fitted to the simulator's step form; the calibrated roofline's step / L."""
    from eldr_cli.costmodel.decode_step import fit_decode_step, layer_shape, time_decode_step

    shape = layer_shape("Qwen3-30B-A3B")
    rows, facts = time_decode_step(shape, device="cuda", repeats=20)
    coef, fit, rows = fit_decode_step(rows)
    return {"shape": shape, "timed": facts["timed"], "coefficients_ms": coef, "fit": fit, "rows": rows}


def decode_step_compiled() -> dict:
    """The same layer through torch.compile (inductor: fused norms, SiLU-and-mul, residual adds) then the
    CUDA graph, as vLLM compiles and captures its models."""
    from eldr_cli.costmodel.decode_step import fit_decode_step, layer_shape, time_decode_step

    shape = layer_shape("Qwen3-30B-A3B")
    rows, facts = time_decode_step(shape, device="cuda", repeats=20, compile=True)
    coef, fit, rows = fit_decode_step(rows)
    return {"shape": shape, "timed": facts["timed"], "coefficients_ms": coef, "fit": fit, "rows": rows}


def lm_head() -> dict:
    """The LM head once per step at Qwen3-30B-A3B's shape (final RMSNorm, [B, 2048] x [2048, 151,936] bf16,
    greedy pick), compiled and replayed from a CUDA graph: what a decode step pays besides its L layers."""
    from eldr_cli.costmodel.decode_step import fit_lm_head, layer_shape, time_lm_head

    rows = time_lm_head(layer_shape("Qwen3-30B-A3B"), batches=(1, 8, 64, 256), device="cuda", compile=True)
    return {"rows": rows, "fit_ms": fit_lm_head(rows)}


def decode_step_maverick() -> dict:
    """The same for one TP8 rank of a Llama-4-Maverick MoE decoder layer (5 query heads, 1 KV head, experts
    1/8 wide, top-1), the deployment of the report's held-out verdict (its dense layers are not timed)."""
    from eldr_cli.costmodel.decode_step import fit_decode_step, layer_shape, time_decode_step

    shape = layer_shape("Llama-4-Maverick", tp=8)
    rows, facts = time_decode_step(shape, device="cuda", repeats=20, compile=True)
    coef, fit, rows = fit_decode_step(rows)
    return {"shape": shape, "timed": facts["timed"], "coefficients_ms": coef, "fit": fit, "rows": rows}


def attention() -> list[dict]:
    import torch

    rows = []
    for b in (8, 64, 256):
        for c in (512, 2048, 8192):
            if b * c > 64 * 8192:
                continue
            q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, 4, c, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)

            def attn(q=q, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            rows.append({"batch": b, "context": c, "kv_bytes": 2 * k.numel() * 2, "graph_ms": _events_ms(_graph(attn))})
    return rows


def plugin_graph() -> dict:
    """Issue 29 item 7 without vLLM: the plugin's router hook (``CaptureState.capture``, bound per layer as
    ``bind_model`` binds it) inside a toy 48-layer router stack run (a) captured in a CUDA graph, (b) through
    torch.compile then a CUDA graph, (c) torch.compile(mode="reduce-overhead") (its own CUDA graphs); each
    replayed on fresh inputs: the picks buffer must equal the eager top-k ids. Then the after-forward work
    (begin_forward + one fused accumulate for all layers) against the per-layer reference, and its cost."""
    import functools

    import torch

    from eldr_cli.kernels import signature_cache as sc_mod
    from eldr_cli.vllm_plugin.capture import CaptureState

    dev = torch.device("cuda")
    Hd, T, nb = 512, 256, 4096
    st = CaptureState(layers=L, experts=E, top_k=K, device=dev, bound=True)
    st.picks = torch.zeros(L, T + 64, K, dtype=torch.int32, device=dev)
    st.token_blocks = torch.zeros(T + 64, dtype=torch.int64, device=dev)

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

    res: dict = {"layers": L, "tokens": T}
    static = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
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
                    static.copy_(torch.randn(T, Hd, device=dev, dtype=torch.bfloat16))
                    st.picks.zero_()
                    run()
                    torch.cuda.synchronize()
                    ok.append(bool(torch.equal(st.picks[:, :T], eager_ids(static.clone()))))
            res[name] = {"picks_equal_eager_on_fresh_inputs": ok}
        except Exception as e:  # noqa: BLE001 - a refusal here is the finding
            res[name] = {"error": repr(e)[:500]}
    # the after-forward work: T tokens over 16-token blocks
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


def _qwen_roofline(gpu: str):
    """(device preset, the calibrated Qwen3-30B-A3B TP1 bf16 roofline of it) for a CUDA device name, or
    (None, None) for a GPU without a preset."""
    from eldr_cli.costmodel.decode_step import gpu_preset
    from eldr_cli.costmodel.roofline import build

    preset = gpu_preset(gpu)
    return (None, None) if preset is None else (preset, build("Qwen3-30B-A3B", device=preset, dtype="bf16", tp=1)[2])


def roofline_step_error(gpu: str, step: dict, head: dict | None = None) -> dict:
    """The calibrated roofline's decode step / L against the measured whole layer, per row (batch >= 8); with
    the LM head measured, also the whole step: roofline step against L x the layer + the LM head."""
    preset, r = _qwen_roofline(gpu)
    if r is None:
        return {"preset": None}
    Ln = r.facts.n_layers
    ratios = [r.step_ms(x["active_experts"] * Ln, [x["context"]] * x["batch"]) / Ln / x["ms"] for x in step["rows"]]
    for x, q in zip(step["rows"], ratios, strict=True):
        x["roofline_over_measured"] = q
    out = {"preset": preset, "step_ratio_min_max": [min(ratios), max(ratios)],
           "within_25pct": all(0.75 <= q <= 1.25 for q in ratios)}
    h = (head or {}).get("fit_ms")
    if h:
        whole = [r.step_ms(x["active_experts"] * Ln, [x["context"]] * x["batch"])
                 / (Ln * x["ms"] + h["h0"] + h["h1"] * x["batch"]) for x in step["rows"]]
        out["whole_step_ratio_min_max"] = [min(whole), max(whole)]
    return out


def roofline_error(gpu: str, moe: dict, attn: list[dict]) -> dict:
    from eldr_cli.costmodel.roofline import calibrated

    preset, r = _qwen_roofline(gpu)
    if r is None:
        return {"preset": None, "note": f"no device preset for {gpu}: no roofline to compare"}
    m = [r.moe_layer_ms(x["batch"], x["active_experts"]) / x["ms"] for x in moe["grouped_graph"]["rows"]
         if x["batch"] >= 8]
    a = [r.attention_layer_ms(x["batch"], x["context"]) / x["graph_ms"] for x in attn]
    return {"preset": preset, "provenance": calibrated(preset, "Qwen3-30B-A3B", "bf16")[1]["provenance"],
            "moe_ratio_min_max": [min(m), max(m)], "attention_ratio_min_max": [min(a), max(a)],
            "within_15pct": all(0.85 <= x <= 1.15 for x in m + a)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results/gpu_check.json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: make gpu-check needs a CUDA GPU, and torch sees none on this machine; nothing written",
              file=sys.stderr)
        return 2
    import triton

    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    doc: dict = {"label": "MEASURED", "device": gpu, "torch": torch.__version__, "triton": triton.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = (("kernels", kernels), ("moe_layer", moe_layer), ("decode_attention", attention),
                ("decode_step", decode_step), ("decode_step_compiled", decode_step_compiled), ("lm_head", lm_head),
                ("decode_step_maverick_tp8", decode_step_maverick),
                ("plugin_graph", plugin_graph),
                ("roofline", lambda: roofline_error(gpu, doc["moe_layer"], doc["decode_attention"])),
                ("roofline_step", lambda: roofline_step_error(gpu, doc["decode_step"], doc.get("lm_head"))),
                ("roofline_step_compiled", lambda: roofline_step_error(gpu, doc["decode_step_compiled"],
                                                                       doc.get("lm_head"))))
    for name, fn in sections:
        t = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' figures
            import traceback

            doc[name] = {"error": repr(e)[:500], "traceback": traceback.format_exc()[-3000:]}
        doc[f"{name}_s"] = round(time.perf_counter() - t, 1)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(doc, indent=1))  # after every section: a later failure keeps these
        print(f"[{doc['wall_s']:.0f} s] {name}: {'ERROR ' + doc[name]['error'] if 'error' in doc[name] else 'ok'}",
              flush=True)
    try:
        _table(doc)
    except Exception as e:  # noqa: BLE001
        print(f"(table failed: {e!r}; the JSON has every section)")
    print(f"-> {out}")
    return 0


def _table(doc: dict) -> None:
    k, m, r = doc["kernels"], doc["moe_layer"], doc["roofline"]
    print(f"gpu-check (MEASURED) on {doc['device']}, torch {doc['torch']}, triton {doc['triton']}; {doc['wall_s']} s")
    for t in ("accumulate_T512", "accumulate_T8192"):
        x = k[t]
        print(f"  {t}: equal {x['equal_to_reference_all_layers']}, 48 layers eager {x['eager_48_layers_ms']:.3f} ms, "
              f"graph {x['graph_48_layers_ms']:.3f} ms ({x['graph_per_layer_us']:.1f} us/layer)")
    print(f"  reduce R=256: equal {k['reduce']['equal_to_reference']}, triton {k['reduce']['triton_ms']:.3f} ms")
    for name, v in m.items():
        if "rows" not in v:
            print(f"  moe-layer {name}: {v}")
            continue
        pts = ", ".join(f"b{x['batch']}/a{x['active_experts']} {x['ms']:.3f}" for x in v["rows"] if x["batch"] == 64)
        print(f"  moe-layer {name}{' (LAUNCH-BOUND)' if v['launch_bound'] else ''}: {pts} ms")
    for key in ("decode_step", "decode_step_compiled", "decode_step_maverick_tp8"):
        ds = doc.get(key, {})
        if "coefficients_ms" not in ds:
            print(f"  {key}: {ds.get('error')}")
            continue
        c, f = ds["coefficients_ms"], ds["fit"]
        print(f"  {key} ({ds['shape']['model']} TP{ds['shape']['tp']}): {c['k0'] * 1e3:.1f} us + "
              f"{c['kb'] * 1e3:.2f} us*active + {c['kt'] * 1e3:.3f} us*batch + {c['kv'] * 1e6:.3f} ns*KV token; "
              f"{f['points']} points, median |res| "
              f"{100 * f['median_abs_rel_error']:.1f}%, max {100 * f['max_abs_rel_error']:.1f}%")
    lh = doc.get("lm_head", {})
    if "fit_ms" in lh:
        print(f"  lm_head (Qwen3-30B-A3B, once per step): {lh['fit_ms']['h0'] * 1e3:.1f} us + "
              f"{lh['fit_ms']['h1'] * 1e3:.3f} us*batch")
    for key in ("roofline_step", "roofline_step_compiled"):
        rs = doc.get(key, {})
        if rs.get("preset"):
            w = rs.get("whole_step_ratio_min_max")
            print(f"  {key}: roofline {rs['preset']} step / L vs measured layer: {rs['step_ratio_min_max'][0]:.2f}-"
                  f"{rs['step_ratio_min_max'][1]:.2f}" + (f"; whole step (48 layers + LM head): {w[0]:.2f}-{w[1]:.2f}"
                                                          if w else ""))
    pg = doc.get("plugin_graph", {})
    for k_ in ("cuda_graph", "compile_then_cuda_graph", "compile_reduce_overhead"):
        if k_ in pg:
            print(f"  plugin hook {k_}: {pg[k_]}")
    if "after_forward_eager_fused_ms" in pg:
        print(f"  after-forward: per-layer {pg['after_forward_eager_per_layer_ms']:.3f} ms, fused "
              f"{pg['after_forward_eager_fused_ms']:.3f} ms, fused in graph "
              f"{pg['after_forward_graph_fused_ms']:.3f} ms;"
              f" equal {pg['after_forward_equal_reference']}")
    print(f"  roofline {r.get('preset')}: " + (f"MoE {r['moe_ratio_min_max'][0]:.2f}-{r['moe_ratio_min_max'][1]:.2f}"
                                               f", attention {r['attention_ratio_min_max'][0]:.2f}-"
                                               f"{r['attention_ratio_min_max'][1]:.2f} (roofline / measured)"
                                               if r.get("preset") else r["note"]))


if __name__ == "__main__":
    sys.exit(main())
