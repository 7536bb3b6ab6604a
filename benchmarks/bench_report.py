"""make bench-report: `eldr report` end to end -- its verdict table and its wall time.

1. A GENERATED trace in the public Orders-in-Chaos layout (3 subjects x 334 = 1,002 requests, L=48, E=128,
   top-8, 64 decode steps; the fixture makes every other of its 96 layers MoE), imported with
   `eldr capture --from-trace`, then
   `eldr report` with its defaults (fit, roofline cost model of the preset of that shape, rates near
   saturation) -- wall time of the report (target <= 60 s on 2 cores), with the 1-min load average.
2. The trace of the trained tiny model when present (``--tiny-trace``, else artifacts/trace), same report
   (it needs --cost-model: no preset has the tiny model's shape; a measured CPU layer model is written).
Prints the verdict table; writes bench-results/report.json. Every TPOT number is SIMULATED.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
KEYS = ("tpot_p50_change_vs_best_lb_pct", "tpot_p99_change_vs_best_lb_pct", "active_experts_change_vs_rr_pct",
        "oracle_share_pct")


def eldr(*args) -> float:
    t = time.perf_counter()
    subprocess.run([PY, "-m", "eldr_cli", *map(str, args)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def report(trace: Path, out: Path, *extra) -> dict:
    load = os.getloadavg()[0]
    wall = eldr("report", "--trace", trace, "--out", out, "--no-progress", *extra)
    doc = json.loads((out / "report.json").read_text())
    return {"trace": str(trace), "report_wall_s": round(wall, 2), "load_avg_1min_at_start": load,
            "load_avg_1min_at_end": os.getloadavg()[0], "verdict": doc["verdict"],
            "cost_model": doc["simulated"]["cost_model"], "routers": doc["simulated"]["routers"],
            "model": doc["trace"]["model"], "requests": doc["trace"]["requests"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results/report.json")
    ap.add_argument("--tiny-trace", default=str(ROOT / "artifacts/trace"))
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from eldr_cli.capture.oic_fixtures import write_oic_tree

    res: dict = {"runs": []}
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        write_oic_tree(d / "src", n_per_subject=334, num_layers=96, num_experts=128, top_k=8, decode_steps=64,
                       prompt_tokens=(40, 200))
        src = next(p for p in (d / "src").glob("*/*") if p.is_dir())
        res["import_s"] = round(eldr("capture", "--from-trace", src, "--out", d / "t", "--no-progress"), 2)
        r = report(d / "t", d / "r")
        r["workload"] = "GENERATED trace in the public layout (imported)"
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
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=float) + "\n")
    t = Table(title="bench-report -- verdict (SIMULATED), % change, negative = better")
    for c in ("workload", "TPOT p50", "TPOT p99", "experts vs RR", "oracle %", "wall s", "load"):
        t.add_column(c)
    for r in res["runs"]:
        v = r["verdict"]
        label = "tiny model" if "tiny" in r["workload"] else "generated"
        t.add_row(label, *[("n/a" if v[k] is None else f"{v[k]:+.1f}") for k in KEYS[:3]],
                  "n/a" if v[KEYS[3]] is None else f"{v[KEYS[3]]:.0f}", f"{r['report_wall_s']:.1f}",
                  f"{r['load_avg_1min_at_start']:.1f}")
    Console(width=80).print(t)
    if "tiny_error" in res:
        print(res["tiny_error"])
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
