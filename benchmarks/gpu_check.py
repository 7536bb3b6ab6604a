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
bench-results/gpu_check.json and prints one table. Not yet in it: the measured whole decode step (issue 29
item 2) and fp8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

L, E, K, BLOCK = 48, 128, 8, 16
QWEN = {"num_experts": 128, "hidden": 2048, "intermediate": 768, "top_k": 8}


def _events_ms(fn, n: int = 30) -> float:
    """Median CUDA-event time of ``fn()`` over ``n`` calls after 3 warm-ups."""
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
    return statistics.median(out)


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
        out[f"accumulate_T{T}"] = {"equal_to_reference_all_layers": equal, "eager_48_layers_ms": eager,
                                   "graph_48_layers_ms": graphed, "graph_per_layer_us": graphed / L * 1e3}
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
    return res


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


def roofline_error(gpu: str, moe: dict, attn: list[dict]) -> dict:
    from eldr_cli.costmodel.calibration import calibrated
    from eldr_cli.costmodel.presets import MODELS, device_facts
    from eldr_cli.costmodel.roofline import Roofline, model_facts

    preset = "H200" if "H200" in gpu else ("H100-SXM" if "H100" in gpu else None)
    if preset is None:
        return {"preset": None, "note": f"no device preset for {gpu}: no roofline to compare"}
    _, bw, tf, _ = device_facts(preset)
    const, doc = calibrated(preset, "Qwen3-30B-A3B", "bf16")
    r = Roofline(model_facts(MODELS["Qwen3-30B-A3B"]), bw, tf, **const(1))
    m = [r.moe_layer_ms(x["batch"], x["active_experts"]) / x["ms"] for x in moe["grouped_graph"]["rows"]
         if x["batch"] >= 8]
    a = [r.attention_layer_ms(x["batch"], x["context"]) / x["graph_ms"] for x in attn]
    return {"preset": preset, "provenance": doc["provenance"], "moe_ratio_min_max": [min(m), max(m)],
            "attention_ratio_min_max": [min(a), max(a)],
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
    for name, fn in (("kernels", kernels), ("moe_layer", moe_layer), ("decode_attention", attention)):
        t = time.perf_counter()
        doc[name] = fn()
        doc[f"{name}_s"] = round(time.perf_counter() - t, 1)
    doc["roofline"] = roofline_error(gpu, doc["moe_layer"], doc["decode_attention"])
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    _table(doc)
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
        pts = ", ".join(f"b{x['batch']}/a{x['active_experts']} {x['ms']:.3f}" for x in v["rows"] if x["batch"] == 64)
        print(f"  moe-layer {name}{' (LAUNCH-BOUND)' if v['launch_bound'] else ''}: {pts} ms")
    print(f"  roofline {r.get('preset')}: " + (f"MoE {r['moe_ratio_min_max'][0]:.2f}-{r['moe_ratio_min_max'][1]:.2f}"
                                               f", attention {r['attention_ratio_min_max'][0]:.2f}-"
                                               f"{r['attention_ratio_min_max'][1]:.2f} (roofline / measured)"
                                               if r.get("preset") else r["note"]))


if __name__ == "__main__":
    sys.exit(main())
