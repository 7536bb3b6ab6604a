"""The proxy's CPU per request, eldr-live against JSQ mode and against the tree before a change (issue 36 item 7).

Stub workers (2 prefill + 2 decode, answering at once) and three `eldr serve-proxy` processes over them: JSQ mode
(no routing artifact: no signature decoded, no drift watch, as `bench_proxy`'s "eldr-proxy jsq" row), eldr-live
from this checkout and eldr-live from the ``--before`` commit (its ``eldr_cli`` unpacked by ``git archive``).
Open-loop Poisson load at ``--rate`` from a separate load-generator process, one proxy at a time, in rounds whose
order alternates (A B C, C B A, ...); each arm's CPU (user + system, all its threads) over the requests it served
is one value per round, and the comparisons are paired per round (mean ratio with a 95% t-interval). Also read:
the drift watch's own thread CPU per scored signature (``eldr_proxy_drift_cpu_seconds_total``). CPU time, not
wall: the machine's other load moves it less. Prints a table, writes bench-results/handoff-cpu.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.base import BIN, environment, order, paired_interval, parser, tree_at, write_result
from benchmarks.base import loadgen as lg
from benchmarks.base.procs import cpu_s, flags, free_ports, metrics, spawn, stop
from benchmarks.base.stubs import fit_routing, local_urls, start_stubs
from eldr_cli.testing.servers import wait_http

WARMUP = 64  # requests each proxy serves before the rounds (counted as the load generator does)


def _start(tmp: Path, name: str, port: int, pre, dec, policy: str, routing: Path | None, tree: Path | None):
    cmd = [str(BIN / "eldr"), "serve-proxy", *([] if routing is None else ["--routing", str(routing)]),
           *flags("--prefill", pre), *flags("--decode", dec), "--policy", policy, "--port", str(port),
           "--log-level", "warning"]
    p = spawn(cmd, tmp / f"{name}.log", env=None if tree is None else {"PYTHONPATH": str(tree)})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 90, proc=p, log=tmp / f"{name}.log")
    return p, url


def _rounds(tmp: Path, arms: dict, rate: float, duration: float, rounds: int) -> dict[str, list[float]]:
    for _, url in arms.values():
        lg.run(tmp, "proxy", rate, 2, url=url)
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in order(list(arms), r):
            p, url = arms[name]
            c0 = cpu_s(p.pid)
            res = lg.run(tmp, "proxy", rate, duration, url=url)
            cpu[name].append((cpu_s(p.pid) - c0) / max(1, res["ok"] + res["errors"] + WARMUP) * 1e6)
            print(f"  round {r} {name}: {cpu[name][-1]:.0f} us/request", flush=True)
    return cpu


def _drift(url: str) -> dict[str, float | None]:
    m = metrics(url)
    cpu, n = m.get("eldr_proxy_drift_cpu_seconds_total"), m.get("eldr_proxy_drift_scored_total")
    skipped = m.get("eldr_proxy_drift_skipped_total")
    per = cpu[0][1] / n[0][1] * 1e6 if cpu and n and n[0][1] else None
    return {"cpu_us_per_scored": per, "scored": n[0][1] if n else None, "skipped": skipped[0][1] if skipped else None}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "bench-results/handoff-cpu.json")
    ap.add_argument("--before", default=None, help="commit of the 'before' arm (default: where this branch left main)")
    ap.add_argument("--rate", type=float, default=200.0, help="offered requests per second")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per arm per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args(argv)
    env = environment()
    tmp = Path(tempfile.mkdtemp(prefix="bench-handoff-cpu-"))
    before = tree_at(a.before, tmp / "before")
    routing = fit_routing(tmp)
    ports = free_ports(7)
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:4])
    procs = [start_stubs(tmp, ports[:4])]
    try:
        arms = {}
        specs = (("jsq", "jsq", None, None), ("eldr-live", "eldr-live", routing, None),
                 ("eldr-live before", "eldr-live", routing, before))
        for (name, policy, rt, tree), port in zip(specs, ports[4:], strict=True):
            arms[name] = _start(tmp, name, port, pre, dec, policy, rt, tree)
            procs.append(arms[name][0])
        cpu = _rounds(tmp, arms, a.rate, a.duration, a.rounds)
        drift = _drift(arms["eldr-live"][1])
    finally:
        for p in procs:
            stop(p)
    ratios = {"eldr-live / jsq": paired_interval(cpu["eldr-live"], cpu["jsq"], ratio=True),
              "eldr-live before / jsq": paired_interval(cpu["eldr-live before"], cpu["jsq"], ratio=True),
              "eldr-live / eldr-live before": paired_interval(cpu["eldr-live"], cpu["eldr-live before"], ratio=True)}
    print(f"CPU per request at {a.rate:.0f} req/s ({a.rounds} rounds of {a.duration:.0f} s; MEASURED, stub workers)")
    for name, xs in cpu.items():
        print(f"  {name:<18} {sum(xs) / len(xs):7.0f} us/request")
    for name, p in ratios.items():
        print(f"  {name:<30} {p['mean']:.3f}  95% CI [{p['ci'][0]:.3f}, {p['ci'][1]:.3f}]  ({p['verdict']})")
    print(f"  drift watch: {drift['cpu_us_per_scored'] or float('nan'):.1f} us of its thread per scored signature, "
          f"{drift['skipped']} skipped")
    out = write_result(a.out, {"rate": a.rate, "rounds": a.rounds, "duration_s": a.duration, "cpu_us_per_request": cpu,
                               "paired_ratios": ratios, "drift_watch": drift, "label": "MEASURED"}, env)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
