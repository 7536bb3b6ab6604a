"""What verifying artifacts on read costs: the sha256 of every data file against the manifest,
done once per artifact per process by every stage that reads one (eldr_cli.artifacts.guard).

1. `eldr fit` on a 1,000-request trace (N=1000 calibration requests, L=48, E=128, GENERATED):
   run_fit with verification on and off, alternating, median of --repeats; plus the verification
   alone (the trace's hash time) as a share of the fit.
2. Verification of a large trace (--big-trace DIR, e.g. ~1 GB from
   `eldr synth-trace --requests 10000 --picks`): seconds and GB/s (page cache warm: the second read).

Prints a table, writes JSON (default bench-results/verify.json). Inputs are GENERATED; these are timings.

    python -m benchmarks.bench_verify --repeats 5 --big-trace /tmp/big1g
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.base import environment, order, parser, write_result


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _verify_s(path: Path) -> float:
    from eldr_cli.artifacts import guard
    from eldr_cli.artifacts.store import Artifact

    guard._VERIFIED.clear()
    art = Artifact(path, verify=False)
    t0 = time.perf_counter()
    guard.verify_on_read(art)
    return time.perf_counter() - t0


def bench_fit(repeats: int) -> dict:
    from eldr_cli.artifacts import guard, store
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    tmp = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    trace = tmp / "trace"
    write_trace(trace, synthetic_trace(1250, 48, 128, 8, seed=0))  # 80% calibration split = 1000
    real = store.verify_on_read
    spent: list[float] = []  # seconds inside verification during one fit

    def timed(art):
        t0 = time.perf_counter()
        try:
            real(art)
        finally:
            spent.append(time.perf_counter() - t0)

    on, off, inside = [], [], []
    for i in range(repeats):
        for verify in order((True, False), i):
            store.verify_on_read = timed if verify else (lambda art: None)
            guard._VERIFIED.clear()
            spent.clear()
            t0 = time.perf_counter()
            run_fit(trace, tmp / f"fit-{i}-{verify}", decoders=16, pairs=20000, figures=False)
            (on if verify else off).append(time.perf_counter() - t0)
            if verify:
                inside.append((sum(spent), len(spent)))
    store.verify_on_read = real
    verify_alone = statistics.median(_verify_s(trace) for _ in range(repeats))
    med_on, med_off = statistics.median(on), statistics.median(off)
    in_fit = statistics.median(s for s, _ in inside)
    return {"trace_bytes": _size(trace), "fit_s_verify_on": on, "fit_s_verify_off": off,
            "median_on_s": med_on, "median_off_s": med_off, "min_on_s": min(on), "min_off_s": min(off),
            "overhead_pct_medians": 100 * (med_on - med_off) / med_off,
            "overhead_pct_mins": 100 * (min(on) - min(off)) / min(off),
            "verify_in_fit_s": in_fit, "verify_calls_in_fit": inside[0][1],
            "verify_in_fit_share_pct": 100 * in_fit / med_off,
            "verify_trace_s": verify_alone, "verify_share_of_fit_pct": 100 * verify_alone / med_off}


def bench_big(path: Path, repeats: int) -> dict:
    size = _size(path)
    _verify_s(path)  # warm the page cache
    times = [_verify_s(path) for _ in range(repeats)]
    med = statistics.median(times)
    return {"path": str(path), "bytes": size, "verify_s": times, "median_s": med, "gb_per_s": size / med / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "bench-results/verify.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-trace", type=Path, default=None, help="a large trace to verify (e.g. ~1 GB)")
    a = ap.parse_args(argv)
    env = environment()
    load = os.getloadavg()
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_before": load, "fit": bench_fit(a.repeats)}
    if a.big_trace is not None:
        res["big"] = bench_big(a.big_trace, max(1, a.repeats // 2))
    res["loadavg_after"] = os.getloadavg()
    f = res["fit"]
    print(f"{'measurement':<44}{'value':>16}")
    print(f"{'fit (N=1000, L=48, E=128), verify off':<44}{f['median_off_s']:>14.2f} s")
    print(f"{'fit (N=1000, L=48, E=128), verify on':<44}{f['median_on_s']:>14.2f} s")
    print(f"{'  difference of medians':<44}{f['overhead_pct_medians']:>+14.1f} %")
    print(f"{'  difference of minima':<44}{f['overhead_pct_mins']:>+14.1f} %")
    print(f"{'  time inside verification during the fit':<44}{1e3 * f['verify_in_fit_s']:>13.1f} ms")
    print(f"{'  ... as a share of the fit (verify off)':<44}{f['verify_in_fit_share_pct']:>14.2f} %")
    print(f"{'  trace verification alone':<44}{1e3 * f['verify_trace_s']:>13.1f} ms")
    print(f"{'  ... as a share of the fit':<44}{f['verify_share_of_fit_pct']:>14.2f} %")
    print(f"{'  trace size':<44}{f['trace_bytes'] / 1e6:>13.1f} MB")
    if "big" in res:
        b = res["big"]
        print(f"{'large trace size':<44}{b['bytes'] / 1e9:>13.2f} GB")
        print(f"{'large trace verification':<44}{b['median_s']:>14.2f} s")
        print(f"{'  throughput (page cache warm)':<44}{b['gb_per_s']:>11.2f} GB/s")
    print(f"load average before {load[0]:.2f}, after {res['loadavg_after'][0]:.2f} ({res['cpus']} CPUs)")
    print(f"-> {write_result(a.out, res, env)}")


if __name__ == "__main__":
    main()
