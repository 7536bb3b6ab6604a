"""make bench-proxy: the serve-proxy's speed and robustness, with the Rust `vllm-router` as the peer.

1. Routing decision (K=16, d = 20 kept layers x 128 experts): median of the shared band decision
   (EldrPolicy.choose -> locality_band) and of the whole handoff (decode the eldr_signature, apply
   the artifact's transform, decide).
2. Added latency against STUB workers that answer at once (eldr_cli.testing.stub_worker, 2 prefill +
   2 decode, one separate process): open-loop Poisson load from a separate load-generator process;
   "direct" = the load generator runs the same PD exchange (prefill leg, then decode leg) against
   the stubs itself; added = proxy percentile - direct percentile at the same rate. Rows for
   eldr serve-proxy (policy eldr) and vllm-router (--vllm-pd-disaggregation, default policies) at
   200 req/s, and a rate sweep for the highest rate with p99 added < 50 ms (no errors, >= 95% of the
   offered rate completed).
3. Soak: 10,000 requests through `eldr serve-proxy` with injected faults (prefill errors and
   timeouts, decode errors, dropped streams, missing signatures, client disconnects): requests
   without a terminal outcome, in-flight counters after, RSS before/after.

Everything binds 127.0.0.1. All workers are stubs: these are proxy-overhead figures, not model
serving figures. Prints a table, writes bench-results/proxy.json.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.base import BIN, environment, order, paired_interval, parser, write_result
from benchmarks.base import loadgen as lg
from benchmarks.base.procs import cpu_s, flags, free_ports, metrics, rss_mb, spawn, stop
from benchmarks.base.stubs import fit_routing, start_stubs
from eldr_cli.testing.servers import wait_http


# ------------------------------------------------------------------------------------------ 1
def bench_decision(n: int = 20000) -> dict:
    from eldr_cli.handoff import decode_counts, encode_counts, pop_signature
    from eldr_cli.routing import RoutingModel, make_router

    rng = np.random.default_rng(0)
    L, E, K = 48, 128, 16
    mask = np.arange(0, 40, 2)  # 20 kept layers -> d = 20 * 128
    cent = rng.random((K, len(mask) * E))
    cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    model = RoutingModel("count-idf", rng.random((L, E)) + 0.1, mask, cent, tau=0.1)
    router = make_router("eldr", K, model=model)
    reqs = []
    for _ in range(256):
        p = rng.dirichlet(np.full(E, 0.3), size=L)
        counts = np.stack([rng.multinomial(300 * 8, p[l]) for l in range(L)])
        reqs.append((counts, encode_counts(counts)))
    loads = [int(x) for x in rng.integers(0, 20, K)]
    for i, (c, _) in enumerate(reqs):  # the decision alone: signatures cached under the request's key
        router.decide(c, loads, key=i)
    choose_ns, handoff_ns, batch_medians = [], [], []
    pc = time.perf_counter_ns
    batches = 5
    for _ in range(batches):  # batches: a quiet batch shows the cost without other tenants' noise
        part = []
        for i in range(n // batches):
            c = reqs[i % 256][0]
            t0 = pc()
            router.decide(c, loads, key=i % 256)
            part.append(pc() - t0)
        batch_medians.append(float(np.median(part) / 1e3))
        choose_ns += part
    for i in range(n // 4):
        ktp = {"eldr_signature": reqs[i % 256][1], "remote_engine_id": "x"}
        t0 = pc()
        enc = pop_signature(ktp)
        router.decide(decode_counts(enc), loads)
        handoff_ns.append(pc() - t0)
    return {"K": K, "d": int(cent.shape[1]), "n": n,
            "decision_median_us": float(np.median(choose_ns) / 1e3),
            "decision_p99_us": float(np.percentile(choose_ns, 99) / 1e3),
            "decision_batch_medians_us": batch_medians, "decision_best_batch_median_us": min(batch_medians),
            "handoff_median_us": float(np.median(handoff_ns) / 1e3),
            "handoff_p99_us": float(np.percentile(handoff_ns, 99) / 1e3),
            "signature_bytes_json": len(json.dumps(reqs[0][1]))}


def _parse_args(argv):
    ap = parser(__doc__, "bench-results/proxy.json")
    ap.add_argument("--concurrency", type=int, default=32, help="the soak's concurrent clients")
    ap.add_argument("--main-duration", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the 50 and 200 req/s rows")
    ap.add_argument("--sweep-duration", type=float, default=6.0)
    ap.add_argument("--sweep", default="300,500,700,1000,1400,2000")
    ap.add_argument("--soak-n", type=int, default=10000)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--extra-policies", default="eldr-live",
                    help="comma-separated policies run as more rows of our proxy, beside eldr and jsq ('' for none)")
    return ap.parse_args(argv)


class Rig:
    """The processes of one run: stub workers, our proxy (policies eldr, jsq and each of ``extra``, e.g.
    eldr-live), the peer twice. Every process started is in ``procs`` and stopped by ``stop_all``."""

    def __init__(self, tmp: Path, routing: Path, extra: tuple[str, ...] = ("eldr-live",)):
        self.tmp, self.routing, self.extra = tmp, routing, extra
        self.ports = free_ports(10 + len(extra))
        self.pre = [f"http://127.0.0.1:{p}" for p in self.ports[:2]]
        self.dec = [f"http://127.0.0.1:{p}" for p in self.ports[2:4]]
        self.ours_url = f"http://127.0.0.1:{self.ports[4]}"
        self.ours_jsq_url = f"http://127.0.0.1:{self.ports[9]}"
        self.procs = []
        self.stubs = self.ours = self.ours_jsq = None
        self.peers = []  # (name, process, url)
        self.ours_extra = []  # (policy, process, url)

    def _start(self, cmd, log, health_url, timeout=60):
        p = spawn(cmd, self.tmp / log)
        self.procs.append(p)
        wait_http(health_url, timeout, proc=p, log=self.tmp / log)
        return p

    def start_stubs(self, token_delay_s=None, log="stubs.log"):
        extra = [] if token_delay_s is None else ["--token-delay-s", str(token_delay_s)]
        self.stubs = start_stubs(self.tmp, self.ports[:4], "--timeout-sleep-s", "2", *extra, log=log)
        self.procs.append(self.stubs)

    def start_ours(self):
        self.ours = self._start([str(BIN / "eldr"), "serve-proxy", "--routing", str(self.routing),
                                 *flags("--prefill", self.pre), *flags("--decode", self.dec), "--policy", "eldr",
                                 "--port", str(self.ports[4]), "--log-level", "warning"],
                                "ours.log", self.ours_url + "/health")
        # the same proxy with the jsq policy: its cost without the signature handoff
        self.ours_jsq = self._start([str(BIN / "eldr"), "serve-proxy", *flags("--prefill", self.pre),
                                     *flags("--decode", self.dec), "--policy", "jsq",
                                     "--port", str(self.ports[9]), "--log-level", "warning"],
                                    "ours-jsq.log", self.ours_jsq_url + "/health")
        for policy, port in zip(self.extra, self.ports[10:], strict=True):  # the same proxy, another policy
            url = f"http://127.0.0.1:{port}"
            p = self._start([str(BIN / "eldr"), "serve-proxy", "--routing", str(self.routing),
                             *flags("--prefill", self.pre), *flags("--decode", self.dec), "--policy", policy,
                             "--port", str(port), "--log-level", "warning"], f"ours-{policy}.log", url + "/health")
            self.ours_extra.append((policy, p, url))

    def start_peers(self):
        """The peer twice: its defaults (cache_aware prefill and decode) and round_robin (least work)."""
        ports = self.ports
        for name, extra, port, prom in (("vllm-router", [], ports[5], ports[7]),
                                        ("vllm-router rr", ["--policy", "round_robin"], ports[6], ports[8])):
            url = f"http://127.0.0.1:{port}"
            p = self._start([str(BIN / "vllm-router"), "--vllm-pd-disaggregation", *flags("--prefill", self.pre),
                             *flags("--decode", self.dec), "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", "--max-concurrent-requests", "8192", "--queue-size", "8192",
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), *extra],
                            f"peer-{port}.log", url + "/health", timeout=90)
            self.peers.append((name, p, url))

    def routers(self):
        return [("eldr", self.ours, self.ours_url), *self.ours_extra,
                ("eldr-proxy jsq", self.ours_jsq, self.ours_jsq_url), *self.peers]

    def stop_all(self):
        for p in self.procs:
            stop(p)


def _measure(rig: Rig, rate, duration, rounds=3):
    """Phases interleaved in `rounds` rounds (direct, eldr, peers, direct, ...) so that drift in the
    machine's other load hits every row alike; latencies pooled per row. Our proxies' order alternates
    between rounds, and each round's added p50 per row is kept (``rounds_added_p50_ms``) for paired
    comparisons."""
    routers = rig.routers()
    direct_kw = {"prefill": rig.pre[0], "decode": rig.dec[0]}
    pooled = {"direct": None, **{name: None for name, _, _ in routers}}
    cpu = {name: [0.0, 0] for name, _, _ in routers}
    per_round: dict = {name: [] for name, _, _ in routers}
    for r in range(rounds):
        res = lg.run(rig.tmp, "direct", rate, duration / rounds, **direct_kw)
        base_p50 = lg.pct(res["lat_s"], 50)
        pooled["direct"] = lg.merge(pooled["direct"], res)
        for name, proc, url in order(routers, r):
            c0 = cpu_s(proc.pid)
            res = lg.run(rig.tmp, "proxy", rate, duration / rounds, url=url)
            cpu[name][0] += cpu_s(proc.pid) - c0
            cpu[name][1] += res["ok"] + res["errors"] + 64  # + the warm-up requests
            pooled[name] = lg.merge(pooled[name], res)
            per_round[name].append(lg.pct(res["lat_s"], 50) - base_p50)
    base = pooled["direct"]
    rows = {"direct": lg.row(base, None)}
    for name, _, _ in routers:
        rows[name] = lg.row(pooled[name], base)
        # router CPU per request: less sensitive to other load on the machine than latency
        rows[name]["cpu_us_per_request"] = cpu[name][0] / max(1, cpu[name][1]) * 1e6
        rows[name]["rounds_added_p50_ms"] = per_round[name]
    return rows


def _rate_sweep(rig: Rig, rates, duration, console):
    """Rates in increasing order until every router failed one: the highest rate per router with no
    errors, p99 added < 50 ms and >= 95% of the offered rate completed."""
    sweep = {}
    names = [name for name, _, _ in rig.routers()]
    best = {name: None for name in names}
    alive = {name: True for name in names}
    for rate in rates:
        if not any(alive.values()):
            break
        rows = _measure(rig, rate, duration)
        sweep[str(int(rate))] = rows
        for name in best:
            r = rows.get(name)
            if r is None or not alive[name]:
                continue
            if r["errors"] == 0 and r["added_p99_ms"] < 50 and r["achieved_rps"] >= 0.95 * rate:
                best[name] = rate
            else:
                alive[name] = False
        console.print(f"  {int(rate)} req/s: " + ", ".join(
            f"{k} p99+{v['added_p99_ms']:.1f}ms ok={v['ok']} err={v['errors']}" for k, v in rows.items()
            if "added_p99_ms" in v))
    return sweep, best


def _outcome_deltas(m0, m1):
    outcomes = {}
    for lab, v in m1.get("eldr_proxy_requests_total", []):
        o = re.search(r'outcome="([^"]+)"', lab).group(1)
        outcomes[o] = outcomes.get(o, 0) + v
    for lab, v in m0.get("eldr_proxy_requests_total", []):
        o = re.search(r'outcome="([^"]+)"', lab).group(1)
        outcomes[o] -= v
    return {k: int(v) for k, v in outcomes.items()}


def _soak_phase(rig: Rig, n, concurrency):
    """A fresh proxy with a short prefill timeout (from a config file) over stubs with a 2 ms token
    delay, so that client disconnects land mid-stream; faults injected by the load generator."""
    stop(rig.ours)
    stop(rig.ours_jsq)
    stop(rig.stubs)
    rig.start_stubs(token_delay_s=0.002, log="stubs-soak.log")
    cfg = rig.tmp / "soak.toml"
    cfg.write_text("\n".join([f'routing = "{rig.routing}"', f"prefill = {json.dumps(rig.pre)}",
                              f"decode = {json.dumps(rig.dec)}", 'policy = "eldr"', f"port = {rig.ports[4]}",
                              "prefill_timeout_s = 0.3", 'log_level = "error"']) + "\n")
    url = rig.ours_url
    ours = rig._start([str(BIN / "eldr"), "serve-proxy", "--config", str(cfg)], "ours-soak.log", url + "/health")
    lg.run_soak(url, 1000, rig.tmp / "soak-warm.json", seed=1)  # warm-up, then RSS "before"
    time.sleep(1.5)
    rss0 = rss_mb(ours.pid)
    m0 = metrics(url)
    soak = lg.run_soak(url, n, rig.tmp / "soak.json", concurrency=concurrency)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:  # timeouts and cancellations settle
        m1 = metrics(url)
        if m1["eldr_proxy_requests_in_progress"][0][1] == 0:
            break
        time.sleep(0.2)
    rss1 = rss_mb(ours.pid)
    done0 = sum(v for _, v in m0.get("eldr_proxy_requests_total", []))
    done1 = sum(v for _, v in m1.get("eldr_proxy_requests_total", []))
    return {
        "requests": soak["sent"], "injected": soak["kinds"], "client_view": soak["client"],
        "wall_s": round(soak["wall_s"], 2),
        "terminal_outcomes": int(done1 - done0), "outcomes": _outcome_deltas(m0, m1),
        "without_terminal_outcome": int(soak["sent"] - (done1 - done0)),
        "in_progress_after": m1["eldr_proxy_requests_in_progress"][0][1],
        "inflight_after": sum(v for _, v in m1.get("eldr_proxy_inflight", [])),
        "rss_before_mb": round(rss0, 1), "rss_after_mb": round(rss1, 1), "rss_delta_mb": round(rss1 - rss0, 1),
        "retries": sum(v for _, v in m1.get("eldr_proxy_retries_total", [])),
        "signature_missing": sum(v for _, v in m1.get("eldr_proxy_signature_missing_total", [])),
    }


def _latency_table(result):
    from rich.table import Table

    t = Table(title="eldr serve-proxy vs vllm-router (stub workers, same load; latencies in ms)")
    for c in ("rate", "router", "ok", "err", "p50", "p99", "added p50", "added p99", "cpu us/req"):
        t.add_column(c, justify="right")
    for rate, rows in [("50", result["latency_50rps"]), ("200", result["latency_200rps"]),
                       *result["sweep"].items()]:
        for name, r in rows.items():
            t.add_row(rate, name, str(r["ok"]), str(r["errors"]), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                      f"{r.get('added_p50_ms', 0):.2f}" if name != "direct" else "-",
                      f"{r.get('added_p99_ms', 0):.2f}" if name != "direct" else "-",
                      f"{r['cpu_us_per_request']:.0f}" if "cpu_us_per_request" in r else "-")
    return t


def _summary(result):
    dec, r200, best = result["decision"], result["latency_200rps"], result["max_rate_p99_added_below_50ms"]
    summary = {
        "decision_median_us": dec["decision_median_us"], "decision_target_us": 20,
        "decision_best_batch_median_us": dec["decision_best_batch_median_us"],
        "handoff_median_us": dec["handoff_median_us"],
        "eldr_added_p50_ms_at_50": result["latency_50rps"]["eldr"]["added_p50_ms"],
        "eldr_added_p50_ms_at_200": r200["eldr"]["added_p50_ms"], "added_p50_target_ms": 1.0,
        "eldr_added_p99_ms_at_200": r200["eldr"]["added_p99_ms"],
        "eldr_max_rate": best["eldr"],
        "eldr_cpu_us_per_request": r200["eldr"]["cpu_us_per_request"],
        "eldr_proxy_jsq_added_p50_ms_at_200": r200["eldr-proxy jsq"]["added_p50_ms"],
        "eldr_proxy_jsq_cpu_us_per_request": r200["eldr-proxy jsq"]["cpu_us_per_request"],
        "eldr_proxy_jsq_max_rate": best["eldr-proxy jsq"],
    }
    if "eldr-live" in r200:  # issue 21's bar: eldr-live's added latency within 10% of eldr's
        r50 = result["latency_50rps"]
        for rate, rows in (("50", r50), ("200", r200)):
            live, eldr = rows["eldr-live"], rows["eldr"]
            summary[f"eldr_live_added_p50_ms_at_{rate}"] = live["added_p50_ms"]
            summary[f"eldr_live_cpu_us_per_request_at_{rate}"] = live["cpu_us_per_request"]
            summary[f"ratio_added_p50_eldr_live_over_eldr_at_{rate}"] = (
                live["added_p50_ms"] / eldr["added_p50_ms"] if eldr["added_p50_ms"] > 0 else None)
            summary[f"ratio_cpu_eldr_live_over_eldr_at_{rate}"] = (live["cpu_us_per_request"]
                                                                    / eldr["cpu_us_per_request"])
            p = paired_interval(live["rounds_added_p50_ms"], eldr["rounds_added_p50_ms"])
            summary[f"eldr_live_minus_eldr_added_p50_ms_at_{rate}"] = p["mean"]
            summary[f"eldr_live_minus_eldr_added_p50_ci95_ms_at_{rate}"] = [round(x, 3) for x in p["ci"]]
        summary["eldr_live_max_rate"] = best.get("eldr-live")
    if "vllm-router" in r200:
        summary["vllm_router_added_p50_ms_at_200"] = r200["vllm-router"]["added_p50_ms"]
        summary["ratio_added_p50_eldr_over_vllm_router"] = (
            r200["eldr"]["added_p50_ms"] / r200["vllm-router"]["added_p50_ms"]
            if r200["vllm-router"]["added_p50_ms"] > 0 else None)
        summary["vllm_router_max_rate"] = best["vllm-router"]
        summary["vllm_router_rr_added_p50_ms_at_200"] = r200["vllm-router rr"]["added_p50_ms"]
        summary["vllm_router_added_p50_ms_at_50"] = result["latency_50rps"]["vllm-router"]["added_p50_ms"]
        summary["vllm_router_rr_added_p50_ms_at_50"] = result["latency_50rps"]["vllm-router rr"]["added_p50_ms"]
        summary["vllm_router_rr_max_rate"] = best["vllm-router rr"]
        rr = r200["vllm-router rr"]["added_p50_ms"]
        summary["ratio_added_p50_eldr_over_vllm_router_rr"] = r200["eldr"]["added_p50_ms"] / rr if rr > 0 else None
        summary["vllm_router_cpu_us_per_request"] = r200["vllm-router"]["cpu_us_per_request"]
        summary["ratio_cpu_eldr_over_vllm_router"] = (r200["eldr"]["cpu_us_per_request"]
                                                      / r200["vllm-router"]["cpu_us_per_request"])
        if summary["vllm_router_max_rate"] and summary["eldr_max_rate"]:
            summary["ratio_max_rate_eldr_over_vllm_router"] = summary["eldr_max_rate"] / summary["vllm_router_max_rate"]
    return summary


def _summary_table(summary, soak):
    from rich.table import Table

    t = Table(title="summary")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    for k in ("requests", "terminal_outcomes", "without_terminal_outcome", "in_progress_after", "inflight_after",
              "rss_before_mb", "rss_after_mb", "rss_delta_mb", "retries", "signature_missing", "wall_s"):
        t.add_row(f"soak {k}", str(soak[k]))
    t.add_row("soak outcomes", json.dumps(soak["outcomes"]))
    return t


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    from rich.console import Console

    console = Console()
    env = environment()
    result = {"machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
              "note": "stub workers (answer at once), all processes on one machine incl. load generator"}
    console.print("[bold]1. routing decision[/] (K=16, d=20x128)")
    result["decision"] = dec = bench_decision()
    console.print(f"  band decision median {dec['decision_median_us']:.2f} us, whole handoff "
                  f"{dec['handoff_median_us']:.2f} us")

    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    console.print("[bold]2. added latency[/] (fitting a routing artifact for the stub shape ...)")
    rig = Rig(tmp, fit_routing(tmp), tuple(p for p in args.extra_policies.split(",") if p))
    try:
        rig.start_stubs()
        rig.start_ours()
        if not args.skip_peer:
            rig.start_peers()
        # a light load first (little queueing: closest to the per-request path cost), then 200 req/s
        result["latency_50rps"] = _measure(rig, 50, args.main_duration, args.rounds)
        result["latency_200rps"] = _measure(rig, 200, args.main_duration, args.rounds)
        rates = [float(x) for x in args.sweep.split(",")]
        result["sweep"], result["max_rate_p99_added_below_50ms"] = _rate_sweep(rig, rates, args.sweep_duration,
                                                                                 console)
        for _, p, _ in [*rig.peers, *rig.ours_extra]:
            stop(p)
        console.print(f"[bold]3. soak[/]: {args.soak_n} requests with injected faults")
        result["soak"] = _soak_phase(rig, args.soak_n, args.concurrency)
    finally:
        rig.stop_all()

    console.print(_latency_table(result))
    result["summary"] = _summary(result)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    console.print(_summary_table(result["summary"], result["soak"]))
    console.print(f"wrote {write_result(args.out, result, env)}")


if __name__ == "__main__":
    main()
