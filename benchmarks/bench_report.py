"""make bench-report: `eldr report` end to end -- its verdict (capacity at SLO, paired seeds) and its wall time.

1. A GENERATED trace in the public Orders-in-Chaos layout (3 subjects x 134 = 402 requests, 48 layers of which
   the 24 odd ones are MoE, E=128, top-1, 128 decode steps: Llama-4-Maverick's shape), imported with
   `eldr capture --from-trace`, then `eldr report` with its defaults: fit, the roofline of the preset of that
   shape, 6 routers incl. the oracle, 5 seeds, a capacity search per router and seed, 4 load points.
   Target: <= 120 s on 2 cores; the 1-min load average is recorded at start and end.
2. The trace of the trained tiny model when present (``--tiny-trace``, else artifacts/trace), same report
   (it needs --cost-model: no preset has the tiny model's shape; a measured CPU layer model is written).
Prints the verdict table; writes bench-results/report.json. Every capacity and TPOT number is SIMULATED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.base import PY, ROOT, environment, parser, write_result


def eldr(*args) -> float:
    t = time.perf_counter()
    subprocess.run([PY, "-m", "eldr_cli", *map(str, args)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def report(trace: Path, out: Path, *extra) -> dict:
    load = os.getloadavg()[0]
    wall = eldr("report", "--trace", trace, "--out", out, "--no-progress", *extra)
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdict"]
    return {"trace": str(trace), "report_wall_s": round(wall, 2), "load_avg_1min_at_start": load,
            "load_avg_1min_at_end": os.getloadavg()[0], "verdict": v, "cost_model": doc["simulated"]["cost_model"],
            "routers": doc["simulated"]["routers"], "seeds": v["seeds"], "simulated_runs": doc["simulated"]["runs"],
            "simulate_s": doc["simulated"]["simulate_s"], "topology": f"{doc['simulated']['prefill']}P"
            f"{doc['simulated']['decode']}D", "model": doc["trace"]["model"], "requests": doc["trace"]["requests"]}


def _ci(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    lo, hi = d["ci95"]
    return f"{d['mean']:+.1f}" + ("" if lo is None else f" [{lo:+.0f},{hi:+.0f}]")


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="bench-report (SIMULATED): eldr vs the best load balancer (LB)")
    for c in ("workload", "LB req/s", "capacity %", "TPOT@75% %", "wall s", "load"):
        t.add_column(c, no_wrap=True)
    for r in res["runs"]:
        v = r["verdict"]
        best = v["best_load_balancer"]
        ch = next((c["tpot_p50_pct"] for c in v["change_vs_best_lb_by_load"]
                   if c["router"] == "eldr" and c["load_pct"] == 75), None)
        t.add_row("tiny model" if "tiny" in r["workload"] else "generated",
                  f"{v['capacity_rps'][best]['mean']:.3g}", _ci(v["capacity_gain_vs_best_lb_pct"].get("eldr")),
                  _ci(ch), f"{r['report_wall_s']:.1f}",
                  f"{r['load_avg_1min_at_start']:.1f}")
    Console(width=80).print(t)
    for r in res["runs"]:
        print(f"best load balancer: {r['verdict']['best_load_balancer']}; [95% CI over seeds, paired]")


def main(argv=None) -> int:
    ap = parser(__doc__, "bench-results/report.json")
    ap.add_argument("--tiny-trace", default=str(ROOT / "artifacts/trace"), help="the tiny model's trace, when present")
    a = ap.parse_args(argv)
    env = environment()
    from eldr_cli.capture.oic_fixtures import write_oic_tree

    res: dict = {"runs": []}
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        write_oic_tree(d / "src", n_per_subject=134, num_layers=48, num_experts=128, top_k=1, decode_steps=128,
                       prompt_tokens=(40, 400), model="Llama-4-Maverick")
        src = next(p for p in (d / "src").glob("*/*") if p.is_dir())
        res["import_s"] = round(eldr("capture", "--from-trace", src, "--out", d / "t", "--no-progress"), 2)
        r = report(d / "t", d / "r")
        r["workload"] = "GENERATED trace in the public layout (imported), Llama-4-Maverick shape"
        res["runs"].append(r)
        tiny = Path(a.tiny_trace)
        if (tiny / "manifest.json").exists():
            eldr("bench", "moe-layer", "--out", d / "cm")
            try:
                r = report(tiny, d / "rt", "--cost-model", d / "cm")
                r["workload"] = "trace of the trained tiny model (captured)"
                res["runs"].append(r)
            except subprocess.CalledProcessError as e:
                res["tiny_error"] = f"eldr report exited {e.returncode} on {tiny}"
        else:
            res["tiny_error"] = f"no tiny-model trace at {tiny} (make capture writes one)"
    out = write_result(a.out, res, env)
    print_table(res)
    for r in res["runs"]:
        print(f"{r['workload']}: {r['topology']}, {r['seeds']} seeds, {len(r['routers'])} routers, "
              f"{r['simulated_runs']} simulated runs ({r['simulate_s']:.0f} s of them); "
              f"wall {r['report_wall_s']:.0f} s at load {r['load_avg_1min_at_start']:.1f}-"
              f"{r['load_avg_1min_at_end']:.1f}")
    if "tiny_error" in res:
        print(res["tiny_error"])
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
