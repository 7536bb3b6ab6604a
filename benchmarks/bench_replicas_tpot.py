"""Replicas route as one proxy would (issue 27, item 5). EMULATED: `eldr emulate` workers whose step times
come from the demo's cost model, with the demo's trace; the real proxy and the real bench client.

One eldr-live proxy process and `--workers N` (N replicas on one port, sharing state over a private
redis-server) front the same emulated xPyD cluster, one after the other, at the same rates, with the same
seeds (the same arrivals and prompts: paired). Per seed and rate: TPOT p50 and p99 of each; the table gives
the paired difference (replicas - one proxy) with a 95% t-interval over the seeds: "no measurable
difference" when it spans 0.

Inputs are the demo's (`make demo`, or `--prepare` builds them the same way: trained tiny model, capture,
CPU cost model, fit for the decoders). Rates: `--capacity R` (req/s, e.g. eldr-live's capacity at the SLO
from `eldr report`) gives 50% and 90% of it; or `--rates` directly.

    python -m benchmarks.bench_replicas_tpot --demo artifacts/demo --rates 12,24 --seeds 5
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.base import BIN, environment, order, paired_interval, parser, write_result
from benchmarks.base.procs import spawn, stop
from benchmarks.base.stubs import start_proxy
from eldr_cli.testing.ports import free_port, free_port_range


def _prepare(demo: Path, decode: int) -> None:
    from eldr_cli import demo as d

    a = d._args(["--out", str(demo), "--decode", str(decode)])
    demo.mkdir(parents=True, exist_ok=True)
    d._prepare(a, demo, [])


def _emulate(tmp: Path, demo: Path, prefill: int, decode: int):
    base = free_port_range(prefill + decode)
    cluster = tmp / "cluster.json"
    p = spawn([str(BIN / "eldr"), "emulate", "--prefill", str(prefill), "--decode", str(decode), "--trace",
               str(demo / "trace"), "--cost-model", str(demo / "cost-model"), "--base-port", str(base),
               "--cluster-file", str(cluster)], tmp / "emulate.log")
    for _ in range(1200):
        if cluster.exists() and cluster.stat().st_size or p.poll() is not None:
            break
        time.sleep(0.1)
    if not cluster.exists():
        raise SystemExit(f"the emulated cluster did not start; see {tmp / 'emulate.log'}")
    time.sleep(0.5)
    return p, cluster, json.loads(cluster.read_text())


def _one_run(tmp: Path, url: str, cluster: Path, rates: list[float], seed: int, args, name: str) -> list[dict]:
    from eldr_cli.bench.serve import run_bench

    out = run_bench(tmp / f"{name}-s{seed}", url=url, prompts=None, rates=rates, duration_s=args.duration,
                    warmup_s=args.warmup, max_tokens=args.max_tokens, seed=seed, cluster_file=cluster, live=False,
                    router_name="eldr-live")
    return json.loads((out / "summary.json").read_text())["runs"]


ROW_KEYS = ("request_rate", "completed", "failed", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms",
            "mean_active_experts_per_step", "mean_decode_batch", "median_step_late_ms", "p99_schedule_lag_ms")
# active experts per step: the routing's effect; step lateness: the emulator short of CPU (4 replicas and a
# redis-server share the cores with it), which lengthens TPOT whatever the routing
METRICS = (("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"), ("mean_active_experts_per_step", "experts"),
           ("median_step_late_ms", "late"))


def _parse(argv):
    ap = parser(__doc__, "bench-results/replicas_tpot.json")
    ap.add_argument("--demo", default="artifacts/demo", help="the demo's directory (trace, cost-model, fit)")
    ap.add_argument("--prepare", action="store_true", help="build the demo's inputs first when missing")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--capacity", type=float, default=None, help="req/s: the rates are 50%% and 90%% of it")
    ap.add_argument("--rates", default="12,24")
    ap.add_argument("--seeds", type=int, default=5, help="paired seeds (the order alternates)")
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    return ap.parse_args(argv)


def _runs(tmp: Path, demo: Path, setups: dict, rates: list[float], args) -> dict:
    """Every setup at every seed, the setups' order alternating between seeds: per setup, one row list per seed."""
    emu, cluster, info = _emulate(tmp, demo, args.prefill, args.decode)
    procs, urls, runs = [emu], {}, {}
    try:
        for i, (name, extra) in enumerate(setups.items()):
            port = free_port()
            procs.append(start_proxy(tmp, f"proxy{i}", info["prefill"], info["decode"], port, "--routing",
                                     str(demo / "fit"), "--policy", "eldr-live", *extra))
            urls[name] = f"http://127.0.0.1:{port}"
        time.sleep(1.5)  # the replicas find each other
        for seed in range(args.seeds):
            for name in order(setups, seed):  # neither always goes first
                rows = _one_run(tmp, urls[name], cluster, rates, seed, args, f"p{list(setups).index(name)}")
                runs.setdefault(name, []).append([{k: r.get(k) for k in ROW_KEYS} for r in rows])
                print(f"seed {seed} {name}: " + ", ".join(
                    f"{r['request_rate']:g}/s TPOT p50 {r['median_tpot_ms']:.2f} p99 {r['p99_tpot_ms']:.2f} ms"
                    for r in rows), flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
    return runs


def _diff(one: list, rep: list, rates: list[float]) -> list[dict]:
    """Per rate and metric: the paired difference replicas - one proxy over the seeds, with its interval."""
    out = []
    for j, rate in enumerate(rates):
        for key, label in METRICS:
            a, b = [s[j][key] for s in one], [s[j][key] for s in rep]
            p = paired_interval(b, a)
            lo, hi = p["ci"]
            verdict = ("no measurable difference" if lo <= 0 <= hi or p["pairs"] < 2 else
                       "higher with replicas" if lo > 0 else "lower with replicas")
            out.append({"rate": rate, "metric": key, "one": float(np.mean(a)), "replicas": float(np.mean(b)),
                        "diff_mean": p["mean"], "ci95": [lo, hi], "verdict": verdict})
            print(f"{rate:>6g} {label:>8} {np.mean(a):>9.2f} {np.mean(b):>9.2f} {p['mean']:>+7.2f} "
                  f"[{lo:+.2f}, {hi:+.2f}] {verdict}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    env = environment()
    demo = Path(args.demo)
    if not (demo / "fit" / "manifest.json").exists():
        if not args.prepare:
            raise SystemExit(f"{demo} has no fit: run `make demo`, or pass --prepare")
        _prepare(demo, args.decode)
    rates = [round(args.capacity * f, 2) for f in (0.5, 0.9)] if args.capacity else \
        [float(r) for r in args.rates.split(",")]
    setups = {"1 proxy": [], f"--workers {args.workers}": ["--workers", str(args.workers)]}
    res: dict = {"mode": "EMULATED", "rates": rates, "seeds": args.seeds, "duration_s": args.duration,
                 "warmup_s": args.warmup, "max_tokens": args.max_tokens, "prefill": args.prefill,
                 "decode": args.decode, "policy": "eldr-live", "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="eldr-reptpot-") as td:
        res["runs"] = _runs(Path(td), demo, setups, rates, args)
    res["load_after"] = os.getloadavg()[0]
    print(f"\nEMULATED, eldr-live, {args.prefill}P{args.decode}D, {args.seeds} paired seeds: replicas - one proxy")
    print(f"{'rate':>6} {'metric':>8} {'1 proxy':>9} {'replicas':>9} {'diff (95% CI)':>24}")
    res["diff"] = _diff(res["runs"]["1 proxy"], res["runs"][f"--workers {args.workers}"], rates)
    print(f"wrote {write_result(args.out, res, env)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
