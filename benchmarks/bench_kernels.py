"""make bench-kernels: the signature-cache kernels (accumulate, reduce) at Qwen3-30B-A3B's shape.

On CUDA: the Triton kernels and the torch reference on the same device, microseconds per call and
effective GB/s against the device's peak bandwidth (ratio = reference / Triton). Without a GPU
(this project's machines): the torch reference on the CPU only, and the output says that no GPU was
present -- no GPU figure is estimated or invented. Writes bench-results/kernels.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

from benchmarks.base import environment, parser, write_result

# Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8; KV block 16 (the paper's setting)
L, E, K, BLOCK = 48, 128, 8, 16


def _timeit(fn, sync, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _peak_gbs(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock_khz = getattr(p, "memory_clock_rate", None)
    bus_bits = getattr(p, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # DDR: two transfers per clock


def run(device_name: str, repeats: int, num_blocks: int) -> list[dict]:
    import torch

    from eldr_cli.kernels import signature_cache as sck

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    g = torch.Generator().manual_seed(0)
    rows = []
    peak = _peak_gbs(device)
    sc = {b: sck.SignatureCache.allocate(num_blocks, L, E, BLOCK, K, device=device) for b in backends}
    item = sc[backends[0]].cache.element_size()
    for T in (256, 2048, 8192):
        # a prefill batch: T tokens in consecutive slots of random blocks
        nb = (T + BLOCK - 1) // BLOCK
        blocks = torch.randperm(num_blocks, generator=g)[:nb]
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)[:T].to(device)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32).to(device)
        tb = torch.zeros(T + 16, dtype=torch.int64, device=device)
        sck.begin_forward(sc[backends[0]], slots, tb)
        tok = tb[:T]
        moved = T * K * 4 + T * 8 + T * K * 8  # ids + block ids + one 32-bit read-modify-write per pick
        res = {}
        for b in backends:
            us = _timeit(lambda b=b, ids=ids, tok=tok: sck.accumulate(sc[b], ids, tok, 7, backend=b), sync, repeats)
            res[b] = statistics.median(us)
        for b in backends:
            gbs = moved / (res[b] * 1e-6) / 1e9
            rows.append({"kernel": "accumulate", "size": f"{T} tok, 1 layer", "backend": b, "device": str(device),
                         "tokens": T,
                         "us_per_call": round(res[b], 2), "effective_GBps": round(gbs, 3),
                         "pct_of_peak": round(100 * gbs / peak, 2) if peak else None,
                         "ratio_vs_triton": round(res[b] / res["triton"], 2) if "triton" in res else None})
        # the whole per-forward capture: begin_forward + L accumulates
        last = backends[-1]

        def forward(slots=slots, tb=tb, ids=ids, tok=tok, last=last):
            sck.begin_forward(sc[last], slots, tb)
            for layer in range(L):
                sck.accumulate(sc[last], ids, tok, layer, backend=last)

        us = _timeit(forward, sync, max(3, repeats // 4))
        rows.append({"kernel": "capture/forward", "size": f"{T} tok, begin+{L} layers", "backend": last,
                     "device": str(device),
                     "tokens": T, "us_per_call": round(statistics.median(us), 1), "effective_GBps": None,
                     "pct_of_peak": None, "ratio_vs_triton": None})
    for R, B in ((1, 64), (32, 64), (128, 128)):
        bt = torch.randint(0, num_blocks, (R, B), generator=g).to(torch.int32).to(device)
        moved = R * B * L * E * item + R * L * E * 4 + R * B * 4
        res = {}
        for b in backends:
            us = _timeit(lambda b=b, bt=bt: sck.reduce(sc[b], bt, backend=b), sync, repeats)
            res[b] = statistics.median(us)
        for b in backends:
            gbs = moved / (res[b] * 1e-6) / 1e9
            rows.append({"kernel": "reduce", "size": f"{R} req x {B} blocks", "backend": b, "device": str(device),
                         "tokens": R * B * BLOCK, "us_per_call": round(res[b], 2), "effective_GBps": round(gbs, 3),
                         "pct_of_peak": round(100 * gbs / peak, 2) if peak else None,
                         "ratio_vs_triton": round(res[b] / res["triton"], 2) if "triton" in res else None})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "bench-results/kernels.json")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on a shared machine more threads mostly wait on each other)")
    args = ap.parse_args(argv)
    env = environment()
    import torch

    torch.set_num_threads(args.threads)

    from eldr_cli.kernels.signature_cache import cell_dtype
    from eldr_cli.vllm_plugin.capture import QWEN3_30B_A3B, signature_share

    has_gpu = torch.cuda.is_available()
    rows = run("cpu", args.repeats, args.num_blocks)
    if has_gpu:
        rows = run("cuda", args.repeats, args.num_blocks) + rows
    share = signature_share(block_size=BLOCK, **QWEN3_30B_A3B)
    result = {
        "shape": {"layers": L, "experts": E, "top_k": K, "block_size": BLOCK, "num_blocks": args.num_blocks,
                  "cell_dtype": str(cell_dtype(BLOCK, K)[0]).removeprefix("torch.")},
        "gpu": torch.cuda.get_device_name(0) if has_gpu else None,
        "gpu_peak_GBps": _peak_gbs(torch.device("cuda")) if has_gpu else None,
        "note": None if has_gpu else
        "NO GPU PRESENT: only the torch reference on the CPU was timed; the Triton kernels were not "
        "timed (their correctness is tested with TRITON_INTERPRET=1, which says nothing about speed).",
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_threads": args.threads,
        "signature_share_of_kv_qwen3_30b_a3b_block16": share,
        "rows": rows,
    }
    out = write_result(args.out, result, env)

    from rich.console import Console
    from rich.table import Table

    con = Console(width=140)
    if not has_gpu:
        con.print("[bold yellow]No GPU present: timing the torch reference on the CPU only; "
                  "no GPU figures are reported.[/]")
    t = Table(title=f"signature-cache kernels, L={L} E={E} top-{K} block {BLOCK}")
    for c in ("kernel", "size", "backend", "device", "us/call", "GB/s", "% peak", "ref/triton"):
        t.add_column(c, justify="right" if c not in ("kernel", "size", "backend", "device") else "left")
    for r in rows:
        t.add_row(r["kernel"], r["size"], r["backend"], r["device"], f"{r['us_per_call']:.0f}",
                  "-" if r["effective_GBps"] is None else f"{r['effective_GBps']:.2f}",
                  "-" if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.1f}",
                  "-" if r["ratio_vs_triton"] is None else f"{r['ratio_vs_triton']:.2f}")
    con.print(t)
    con.print(f"signature cache / KV cache for Qwen3-30B-A3B (L=48, E=128, block 16, bf16 KV): {100 * share:.3f}%")
    con.print(f"wrote {out}")


if __name__ == "__main__":
    main()
