"""make bench-proxy (part 2): eldr serve-proxy beyond one process, against STUB workers.

1. Capacity: the same open-loop Poisson load (bench_proxy's load generator, separate processes) through
   - one `eldr serve-proxy` process,
   - `eldr serve-proxy --workers 2` (two processes on one port, private redis-server),
   - two replicas over one redis-server (the load split evenly between them),
   - the Rust `vllm-router --policy round_robin` (the peer; single process),
   with "direct" (the load generator runs the PD exchange itself) as the baseline: highest rate with
   p99 added < 50 ms (no errors, >= 95% of the offered rate completed), added p50 at 200 req/s, and
   router CPU per request (all of a row's processes, redis-server included).
2. Routing quality with two replicas vs one (policy eldr, 2P4D, slow streams so requests stay in flight,
   the same arrivals split over the replicas): the spread of requests running at the decoders (max - min
   of the stubs' own counts, sampled every 50 ms) and the share of decisions inside the locality band
   of their signature (the band depends only on the signature and tau, so this holds by construction;
   it guards against a replica deciding with another artifact or tau).
3. Failover soak: 5,000 streamed requests split between two replicas; one replica is SIGKILLed at
   40%, the redis-server is killed and restarted at 70%: requests on the survivor must all reach a
   terminal outcome without error, its counters must return to 0, and the dead replica's load must
   leave the survivor's view within the staleness bound.

Everything binds 127.0.0.1. Prints tables, writes bench-results/replicas.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.base import BIN, environment, parser, write_result
from benchmarks.base import loadgen as lg
from benchmarks.base.procs import cpu_s, flags, metrics, spawn, stop
from benchmarks.base.stubs import fit_routing, local_urls, sample_spread, start_proxy, start_stubs
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.proxy.replicas.shared import STALENESS_BOUND_S
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import wait_http


# --------------------------------------------------------------------------------------------- 1
def capacity(tmp, args, routing, redis):
    ports = [free_port() for _ in range(4)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    procs = [start_stubs(tmp, ports, "--timeout-sleep-s", "2")]
    rows_def = {}
    try:
        base = ["--routing", str(routing), "--policy", "eldr"]
        p1 = free_port()
        procs.append(start_proxy(tmp, "one", pre, dec, p1, *base))
        rows_def["eldr, 1 process"] = ([procs[-1]], [f"http://127.0.0.1:{p1}"])
        pw = free_port()
        procs.append(start_proxy(tmp, "workers2", pre, dec, pw, *base, "--workers", "2"))
        rows_def["eldr, --workers 2"] = ([procs[-1]], [f"http://127.0.0.1:{pw}"])
        ra, rb = free_port(), free_port()
        pa = start_proxy(tmp, "replica-a", pre, dec, ra, *base, "--state", redis.url)
        pb = start_proxy(tmp, "replica-b", pre, dec, rb, *base, "--state", redis.url)
        procs += [pa, pb]
        rows_def["eldr, 2 replicas + Redis"] = ([pa, pb, redis.proc], [f"http://127.0.0.1:{ra}", f"http://127.0.0.1:{rb}"])
        if not args.skip_peer and (BIN / "vllm-router").exists():
            pr, prom = free_port(), free_port()
            p = spawn([str(BIN / "vllm-router"), "--vllm-pd-disaggregation",
                           *flags("--prefill", pre), *flags("--decode", dec),
                           "--host", "127.0.0.1", "--port", str(pr),
                           "--log-level", "warning", "--max-concurrent-requests", "8192", "--queue-size", "8192",
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--policy", "round_robin"],
                          tmp / "peer.log")
            procs.append(p)
            wait_http(f"http://127.0.0.1:{pr}/health", 90, proc=p)
            rows_def["vllm-router round_robin"] = ([p], [f"http://127.0.0.1:{pr}"])
        result: dict = {"rates": {}, "max_rate_p99_added_below_50ms": {k: None for k in rows_def}}
        alive = {k: True for k in rows_def}
        for rate in [float(x) for x in args.rates.split(",")]:
            if not any(alive.values()):
                break
            base_res = lg.run(tmp, "direct", rate, args.duration, prefill=pre[0], decode=dec[0])
            rows = {"direct": lg.row(base_res, None)}
            for name, (ps, urls) in rows_def.items():
                if not alive[name] and rate != 200:
                    continue
                c0 = sum(cpu_s(p.pid) for p in ps)
                res = lg.split(tmp, urls, rate, args.duration)
                cpu = sum(cpu_s(p.pid) for p in ps) - c0
                r = lg.row(res, base_res)
                r["cpu_us_per_request"] = cpu / max(1, res["ok"] + res["errors"] + 64 * len(urls)) * 1e6
                rows[name] = r
                ok = r["errors"] == 0 and r["added_p99_ms"] < 50 and r["achieved_rps"] >= 0.95 * rate
                if ok and alive[name]:
                    result["max_rate_p99_added_below_50ms"][name] = rate
                elif not ok:
                    alive[name] = False
            result["rates"][str(int(rate))] = rows
            print(f"  {int(rate)} req/s: " + ", ".join(f"{k} +{v['added_p99_ms']:.1f}ms p99 err={v['errors']}"
                                                        for k, v in rows.items() if "added_p99_ms" in v), flush=True)
        return result
    finally:
        for p in procs:
            stop(p)


# --------------------------------------------------------------------------------------------- 2
async def _stream_load(urls, rate, duration, seed, max_tokens):
    """Poisson arrivals of streamed requests, round-robin over ``urls``; client-side outcomes."""
    import aiohttp

    rng = np.random.default_rng(seed)
    prompts = [f"prompt {i}: " + " ".join(f"word{(i * 31 + j) % 97}" for j in range(40)) for i in range(64)]
    outcome = {"ok": 0, "error": 0}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i):
            try:
                async with s.post(urls[i % len(urls)] + "/v1/completions",
                                  json={"model": "m", "prompt": prompts[i % 64], "max_tokens": max_tokens,
                                        "stream": True}) as r:
                    await r.read()
                    outcome["ok" if r.status == 200 else "error"] += 1
            except Exception:
                outcome["error"] += 1

        tasks, t = [], time.perf_counter()
        for i in range(int(rate * duration)):
            t += rng.exponential(1 / rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
    return outcome


def quality(tmp, args, routing4, redis):
    import threading

    ports = [free_port() for _ in range(6)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    stubs = start_stubs(tmp, ports, "--token-delay-s", "0.05")
    out = {}
    try:
        for name, n in (("1 proxy", 1), ("2 replicas + Redis", 2)):
            procs, urls, logs = [], [], []
            for i in range(n):
                port = free_port()
                log = tmp / f"decisions-{n}-{i}.jsonl"
                extra = ["--state", redis.url] if n > 1 else []
                procs.append(start_proxy(tmp, f"q{n}{i}", pre, dec, port, "--routing", str(routing4), "--policy",
                                         "eldr", "--decision-log", str(log), *extra))
                urls.append(f"http://127.0.0.1:{port}")
                logs.append(log)
            done, spreads = threading.Event(), []
            th = threading.Thread(target=sample_spread, args=(dec, done, spreads))
            th.start()
            outcome = asyncio.run(_stream_load(urls, args.quality_rate, args.quality_duration, 7, 20))
            done.set()
            th.join()
            for p in procs:
                stop(p)  # flushes the decision logs
            rows = [json.loads(x) for log in logs for x in log.read_text().splitlines()]
            in_band = [r["chosen"] in r["band"] for r in rows if r.get("band") is not None]
            out[name] = {"requests": outcome, "decisions": len(rows),
                         "in_band_share": float(np.mean(in_band)) if in_band else None,
                         "spread_max": int(max(spreads)) if spreads else None,
                         "spread_mean": float(np.mean(spreads)) if spreads else None,
                         "spread_p99": float(np.percentile(spreads, 99)) if spreads else None}
            print(f"  {name}: {out[name]}", flush=True)
        one, two = out["1 proxy"], out["2 replicas + Redis"]
        out["spread_max_ratio_2_over_1"] = (two["spread_max"] / one["spread_max"]) if one["spread_max"] else None
        out["spread_p99_ratio_2_over_1"] = (two["spread_p99"] / one["spread_p99"]) if one["spread_p99"] else None
        return out
    finally:
        stop(stubs)


# --------------------------------------------------------------------------------------------- 3
async def _soak_client(url, n, concurrency, counter):
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one(i):
            async with sem:
                try:
                    async with s.post(url + "/v1/completions", json={
                            "model": "m", "prompt": f"soak {i}", "max_tokens": 4, "stream": True}) as r:
                        await r.read()
                        counter["ok" if r.status == 200 else f"http_{r.status}"] += 1
                except Exception as e:
                    counter[type(e).__name__] += 1
                counter["done"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))


def failover(tmp, args, routing, redis):
    import collections
    import threading

    ports = [free_port() for _ in range(4)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    stubs = start_stubs(tmp, ports, "--token-delay-s", "0.002")
    pa, pb = free_port(), free_port()
    a = start_proxy(tmp, "soak-a", pre, dec, pa, "--routing", str(routing), "--state", redis.url)
    b = start_proxy(tmp, "soak-b", pre, dec, pb, "--routing", str(routing), "--state", redis.url)
    ua, ub = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    ca: collections.Counter = collections.Counter()
    cb: collections.Counter = collections.Counter()
    half = args.soak_n // 2
    res: dict = {"requests": args.soak_n, "staleness_bound_s": STALENESS_BOUND_S}
    try:
        ta = threading.Thread(target=lambda: asyncio.run(_soak_client(ua, half, 16, ca)))
        tb = threading.Thread(target=lambda: asyncio.run(_soak_client(ub, args.soak_n - half, 16, cb)))
        ta.start()
        tb.start()
        while ca["done"] + cb["done"] < 0.4 * args.soak_n:
            time.sleep(0.01)
        with httpx.Client(timeout=2) as c:  # the survivor must see the victim's load before it dies
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:
                ws = c.get(ua + "/health").json()["workers"]
                res["victim_load_seen_before_kill"] = sum(w["cluster_inflight"] - w["inflight"] for w in ws)
                if res["victim_load_seen_before_kill"] > 0:
                    break
        os.killpg(b.pid, signal.SIGKILL)  # the replica and nothing else of its group
        t_kill = time.monotonic()
        gone_after = None
        with httpx.Client(timeout=2) as c:
            while time.monotonic() - t_kill < 10:
                ws = c.get(ua + "/health").json()["workers"]
                if all(w["cluster_inflight"] == w["inflight"] for w in ws):
                    gone_after = time.monotonic() - t_kill
                    break
                time.sleep(0.02)
        res["dead_load_gone_after_s"] = gone_after
        while ca["done"] + cb["done"] < 0.7 * args.soak_n and ta.is_alive():
            time.sleep(0.01)
        redis.kill()
        time.sleep(1.0)
        redis.start()
        ta.join()
        tb.join()
        with httpx.Client(timeout=2) as c:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10:
                h = c.get(ua + "/health").json()
                if h["in_progress"] == 0 and all(w["inflight"] == 0 for w in h["workers"]):
                    break
                time.sleep(0.1)
            m = metrics(ua)
        res["survivor"] = {"sent": half, "client": dict(ca), "in_progress_after": h["in_progress"],
                           "inflight_after": sum(w["inflight"] for w in h["workers"]),
                           "state_outages": sum(v for _, v in m.get("eldr_proxy_state_outages_total", [])),
                           "replicas_after": h["replicas"]}
        res["killed_replica_client"] = dict(cb)
        print(f"  {res}", flush=True)
        return res
    finally:
        for p in (a, b, stubs):
            stop(p)


def _tables(console, result: dict) -> None:
    from rich.table import Table

    cap = result["capacity"]
    t = Table(title="proxy replicas vs one process (STUB workers; ms, CPU us/req)")
    for c in ("router", "max rate", "add p50@200", "add p99@200", "CPU/req"):
        t.add_column(c, justify="left" if c == "router" else "right")
    r200 = cap["rates"].get("200", {})
    for name, best in cap["max_rate_p99_added_below_50ms"].items():
        r = r200.get(name, {})
        t.add_row(name, str(int(best)) if best else "-", f"{r.get('added_p50_ms', float('nan')):.2f}",
                  f"{r.get('added_p99_ms', float('nan')):.2f}", f"{r.get('cpu_us_per_request', float('nan')):.0f}")
    console.print(t)
    t2 = Table(title="summary")
    t2.add_column("figure")
    t2.add_column("value", justify="right")
    for k, v in result["summary"].items():
        t2.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(t2)


def _summary(result: dict) -> dict:
    best = result["capacity"]["max_rate_p99_added_below_50ms"]
    one, w2 = best.get("eldr, 1 process"), best.get("eldr, --workers 2")
    return {
        "workers2_over_one_max_rate": (w2 / one) if one and w2 else None,
        "spread_max_ratio_2_over_1": result["quality"]["spread_max_ratio_2_over_1"],
        "in_band_share_2_replicas": result["quality"]["2 replicas + Redis"]["in_band_share"],
        "dead_load_gone_after_s": result["failover"]["dead_load_gone_after_s"],
        "survivor_failed": sum(v for k, v in result["failover"]["survivor"]["client"].items()
                               if k not in ("ok", "done")),
    }


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    ap = parser(__doc__, "bench-results/replicas.json")
    ap.add_argument("--rates", default="200,400,600,800,1000,1300,1600", help="the capacity part's rates, req/s")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per rate and row")
    ap.add_argument("--quality-rate", type=float, default=40.0)
    ap.add_argument("--quality-duration", type=float, default=15.0)
    ap.add_argument("--soak-n", type=int, default=5000, help="requests of the failover soak")
    ap.add_argument("--skip-peer", action="store_true", help="without vllm-router")
    args = ap.parse_args(argv)
    console = Console()
    env = environment()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    routing2, routing4 = fit_routing(tmp, decoders=2), fit_routing(tmp, decoders=4)
    result: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
                    "note": "stub workers; proxies, redis-server, stubs and load generators on one 2-core machine"}
    with RedisServer() as redis:
        console.print("[bold]1. capacity[/] (stub workers that answer at once)")
        result["capacity"] = capacity(tmp, args, routing2, redis)
        console.print("[bold]2. routing quality[/], 1 proxy vs 2 replicas (2P4D, slow streams)")
        result["quality"] = quality(tmp, args, routing4, redis)
        console.print(f"[bold]3. failover soak[/]: {args.soak_n} requests, SIGKILL one replica, restart Redis")
        result["failover"] = failover(tmp, args, routing2, redis)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["summary"] = _summary(result)
    _tables(console, result)
    console.print(f"wrote {write_result(args.out, result, env)}")


if __name__ == "__main__":
    main()
