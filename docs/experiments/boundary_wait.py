"""How long a request waits from its admission to a decoder until its first token, per router (SIMULATED).

An experiment, not part of eldr: it runs the report's simulator setup on one trace at one rate and reads each
measured request's admission time and first-token time from the decode pool (``SimulatedCluster.run`` wrapped),
beside TTFT and TPOT. With equal TPOT (equal step lengths), a longer admission -> first token means the request
waited longer for its decoder's step boundary. docs/routing.md quotes its output on the trained tiny trace:

    python docs/experiments/boundary_wait.py TRACE FIT COST_MODEL --rate 60 --prefill 128 --decode 8 \
        --max-tokens 32 --slo-tpot-ms 140 --slo-ttft-ms 1300
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.costmodel import CostModel
from eldr_cli.report.study import ReportPlan, build_setup, measure
from eldr_cli.simulator import cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("fit", type=Path)
    ap.add_argument("cost_model", type=Path)
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--routers", default="round-robin,jsq,eldr-live")
    a = ap.parse_args()
    plan = ReportPlan(a.trace, read_trace(a.trace), a.fit, a.cost_model, CostModel.load(a.cost_model), "evaluation",
                      a.decode, a.max_tokens, 0.0, tuple(range(a.seeds)), slo_tpot_ms=a.slo_tpot_ms,
                      slo_ttft_ms=a.slo_ttft_ms, prefill=a.prefill)
    setup, _, _, _ = build_setup(plan, [])
    waits: list[float] = []
    run = cluster.SimulatedCluster.run

    def recording_run(self):
        out = run(self)
        dec = self.dec
        ok = np.isfinite(dec.req_first) & ~np.asarray(self.schedule.warmup, dtype=bool)
        waits.append(float(((dec.req_first - dec.admit_t)[ok] * 1e3).mean()))
        return out

    cluster.SimulatedCluster.run = recording_run  # type: ignore[method-assign]
    print("SIMULATED; ms; admission -> first token is the mean over the measured requests")
    print(f"{'seed':>4} {'router':<12} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'admit->1st':>11}")
    for seed in plan.seeds:
        for router in a.routers.split(","):
            m = measure(setup, setup.arrivals(seed), router, a.rate, seed)
            print(f"{seed:>4} {router:<12} {m['ttft_p50_ms']:>9.0f} {m['ttft_p90_ms']:>9.0f} "
                  f"{m['tpot_p50_ms']:>9.1f} {waits[-1]:>11.1f}")


if __name__ == "__main__":
    main()
