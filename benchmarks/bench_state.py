"""Signed shared state (issue 23): what signing costs, and the herd of replicas. STUB workers throughout.

1. ``sign``: CPU per decision path of the signed counts message against the unsigned one it replaced:
   building + sealing this replica's counts (done at most once per 10 ms burst, at most once per
   decision) and opening + accepting it on another replica (each other replica does it once).
   In-process, ``time.process_time`` over many messages; no Redis involved.
2. ``cpu``: 2 replicas over one redis-server, CPU per request (both replicas + redis-server) at a fixed
   Poisson rate, BEFORE (the branch's merge base with main, unpacked by ``git archive``) and AFTER
   (this tree), in interleaved rounds against the same stubs and the same redis-server (a database each).
3. ``herd``: bursts of arrivals (all requests of a burst at once, streamed slowly so they stay in
   flight) through one proxy vs ``--workers 4`` (4 processes on one port, private redis-server); the
   largest spread of requests running AT THE DECODERS (max - min of the stubs' own counts, sampled
   every 20 ms). EMULATED: stub decoders, no model. ``--herd-policy eldr-live`` runs it with eldr-live
   (a routing artifact of the stubs' shape is fitted first).

Prints tables, writes bench-results/state.json. Usage: ``python -m benchmarks.bench_state [--parts sign,cpu,herd]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson

from benchmarks.base import PY, ROOT, environment, order, paired_interval, parser, tree_at, write_result
from benchmarks.base import loadgen as lg
from benchmarks.base.procs import cpu_s, flags, metrics, spawn, stop
from benchmarks.base.stubs import KEY, fit_routing, local_urls, sample_spread, start_proxy, start_stubs
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import wait_http

W4 = ["--workers", "4"]
HERD_VARIANTS = [("1 proxy", []), ("--workers 4, no reservation", W4 + ["--state-reserve-ms", "0"])] + [
    (f"--workers 4, reservation ({ms} ms)", W4 + ["--state-reserve-ms", ms]) for ms in ("50", "500")]


# ------------------------------------------------------------------------------------------ 1
class _W:
    def __init__(self, role, i):
        self.role, self.url, self.id, self.inflight = role, f"http://10.0.0.{i}:8100", f"{role[0]}{i}", i % 7


def _state_with(workers, vectors):
    from eldr_cli.proxy.replicas.conn import StateConn
    from eldr_cli.proxy.replicas.shared import RedisState

    class Host:
        def all_workers(self):
            return workers

        def apply_remote_change(self, action, body):
            pass

        def local_vectors(self):
            return {}

        def remote_vectors_changed(self):
            pass

    st = RedisState(StateConn("redis://127.0.0.1:1/0"), b"k" * 32)
    st._host = Host()
    if vectors:
        st.local_vectors["live"] = {w.id: list(range(vectors)) for w in workers if w.role == "decode"}
    return st


def _cpu_us(fn, n):
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def _sign_case(workers, vec: int, n: int) -> dict:
    a, b = _state_with(workers, vec), _state_with(workers, 0)

    def old_pub():
        return orjson.dumps({"origin": "x", "v": 1, "counts": {f"{w.role}|{w.url}": w.inflight for w in workers}})

    old = old_pub()

    def old_sub():
        m = orjson.loads(old)
        return {str(k): int(c) for k, c in m["counts"].items()}

    reps = []
    for _ in range(3):  # interleaved repeats; the median is reported
        msg = a._sealed_counts()  # fresh: inside the 5 s window while it is opened n times
        body = msg.partition(b".")[2]
        reps.append((_cpu_us(a._sealed_counts, n), _cpu_us(lambda m=msg: b._accept_counts(m), n),
                     _cpu_us(old_pub, n), _cpu_us(old_sub, n), _cpu_us(lambda x=body: a.env._tag(x), n)))
    seal, opn, opub, osub, tag = (float(np.median([r[i] for r in reps])) for i in range(5))
    return {"seal_us": seal, "open_us": opn, "unsigned_publish_us": opub, "unsigned_receive_us": osub,
            "signed_path_us": seal + opn, "hmac_us": tag, "added_us": seal + opn - opub - osub,
            "message_bytes": len(msg), "unsigned_bytes": len(old)}


def bench_sign(n: int = 20000) -> dict:
    out = {}
    for n_dec, vec in ((4, 0), (16, 0), (16, 64)):
        workers = [_W("prefill", i) for i in range(2)] + [_W("decode", i) for i in range(n_dec)]
        out[f"{n_dec}D{'+vec' + str(vec) if vec else ''}"] = _sign_case(workers, vec, n)
    return out


# ------------------------------------------------------------------------------------------ 2
def _replica(tmp, name, tree, pre, dec, state, port, *extra):
    env = {"PYTHONPATH": str(tree), "ELDR_STATE_KEY": KEY}  # both trees accept a 256-bit hex key
    # cwd = the tree: `python -m` puts the working directory before PYTHONPATH (with cwd = the checkout, the
    # "before" replicas ran this tree's code)
    p = spawn([PY, "-m", "eldr_cli", "serve-proxy", *flags("--prefill", pre), *flags("--decode", dec), "--port",
               str(port), "--log-level", "warning", "--policy", "jsq", "--state", state, *extra], tmp / f"{name}.log",
              env=env, cwd=tree)
    wait_http(f"http://127.0.0.1:{port}/health", 90, proc=p)
    return p


def bench_cpu(tmp: Path, rate: float, duration: float, rounds: int, before_rev: str | None = None) -> dict:
    ports = [free_port() for _ in range(4)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    before = tree_at(before_rev, tmp / "before")
    procs = [start_stubs(tmp, ports)]
    rows = (("before", before, 1, []), ("after", ROOT, 2, []),
            ("after, reservation off", ROOT, 3, ["--state-reserve-ms", "0"]))
    res: dict = {"rate": rate, "duration_s": duration, "rounds": rounds, "before_rev": before_rev,
                 **{r[0]: [] for r in rows}}
    with RedisServer() as redis:
        try:
            variants = {}
            for name, tree, db, extra in rows:
                rp = [free_port(), free_port()]
                ps = [_replica(tmp, f"{name[:5]}{db}{i}", tree, pre, dec, f"redis://127.0.0.1:{redis.port}/{db}",
                               rp[i], *extra) for i in range(2)]
                procs += ps
                variants[name] = (ps, [f"http://127.0.0.1:{p}" for p in rp])
            time.sleep(1.0)
            for r in range(rounds):
                for name in order(variants, r):
                    ps, urls = variants[name]
                    c0 = sum(cpu_s(p.pid) for p in ps) + cpu_s(redis.proc.pid)
                    out = lg.split(tmp, urls, rate, duration)
                    cpu = sum(cpu_s(p.pid) for p in ps) + cpu_s(redis.proc.pid) - c0
                    res[name].append({"cpu_us_per_request": cpu / max(1, out["ok"]) * 1e6, "ok": out["ok"],
                                      "errors": out["errors"]})
        finally:
            for p in procs:
                stop(p)
    b = np.median([r["cpu_us_per_request"] for r in res["before"]])
    for name, *_ in rows:
        res[f"median_us[{name}]"] = float(np.median([r["cpu_us_per_request"] for r in res[name]]))
        res[f"ratio_to_before[{name}]"] = res[f"median_us[{name}]"] / float(b)
        # paired by round (the variants of a round ran back to back): mean ratio and a 95% t-interval
        p = paired_interval([x["cpu_us_per_request"] for x in res[name]],
                            [y["cpu_us_per_request"] for y in res["before"]], ratio=True)
        res[f"paired_ratio[{name}]"] = {"per_round": [round(x, 4) for x in p["per_pair"]], "mean": p["mean"],
                                        "ci95": p["ci"]}
    return res


# ------------------------------------------------------------------------------------------ 3
async def _bursts(url, n_bursts, size, gap_s, max_tokens):
    import aiohttp

    outcome = {"ok": 0, "error": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(i):
            try:
                async with s.post(url + "/v1/completions", json={"model": "m", "prompt": f"burst {i} " + "w " * 40,
                                                                 "max_tokens": max_tokens, "stream": True}) as r:
                    await r.read()
                    outcome["ok" if r.status == 200 else "error"] += 1
            except Exception:
                outcome["error"] += 1

        tasks = []
        for b in range(n_bursts):
            tasks += [asyncio.ensure_future(one(b * size + i)) for i in range(size)]
            await asyncio.sleep(gap_s)
        await asyncio.gather(*tasks)
    return outcome


def herd_variants(args) -> list[tuple[str, list[str]]]:
    """One proxy, then (``--herd-workers 2,4,8``) N replicas with the reservation (50 ms) for each N; without
    the option, the default set (4 replicas without and with the reservation at 50 and 500 ms)."""
    if not args.herd_workers:
        return HERD_VARIANTS
    return [("1 proxy", [])] + [(f"--workers {n}, reservation (50 ms)", ["--workers", n, "--state-reserve-ms", "50"])
                                for n in args.herd_workers.split(",")]


def bench_herd(tmp: Path, args) -> dict:
    ports = [free_port() for _ in range(6)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    stubs = start_stubs(tmp, ports, "--token-delay-s", "0.05")
    out: dict = {"burst_size": args.burst_size, "bursts": args.bursts, "gap_s": args.burst_gap_s,
                 "max_tokens": 20, "policy": args.herd_policy, "note": "EMULATED: stub decoders"}
    policy = ["--policy", args.herd_policy]
    if args.herd_policy != "jsq":  # a routing artifact of the stubs' shape, one cluster per decoder
        policy += ["--routing", str(fit_routing(tmp / "herd", decoders=len(dec)))]
    try:
        for _ in range(args.herd_rounds):
            for name, extra in herd_variants(args):
                port = free_port()
                p = start_proxy(tmp, f"herd{len(out)}", pre, dec, port, *policy, *extra)
                time.sleep(1.0)  # the workers find each other
                done, spreads = threading.Event(), []
                th = threading.Thread(target=sample_spread, args=(dec, done, spreads))
                th.start()
                t0 = time.perf_counter()
                outcome = asyncio.run(_bursts(f"http://127.0.0.1:{port}", args.bursts, args.burst_size,
                                              args.burst_gap_s, 20))
                wall = time.perf_counter() - t0
                done.set()
                th.join()
                stop(p)
                out.setdefault(name, []).append({"requests": outcome, "wall_s": wall,
                                                 "spread_max": int(max(spreads)) if spreads else None,
                                                 "spread_p99": float(np.percentile(spreads, 99)) if spreads else None,
                                                 "spread_mean": float(np.mean(spreads)) if spreads else None})
                print(f"  {name}: {out[name][-1]}", flush=True)
    finally:
        stop(stubs)
    one = max(r["spread_max"] for r in out["1 proxy"])
    for name, _ in herd_variants(args)[1:]:
        four = max(r["spread_max"] for r in out[name])
        out[f"spread_max_ratio[{name}] / 1 proxy"] = four / one if one else None
    return out


def bench_reserve_latency(tmp: Path, rate: float, duration: float, rounds: int) -> dict:
    """Client latency at a fixed Poisson rate through --workers 4 with and without the reservation
    (stubs that answer at once: the figures are the proxy's own added time), interleaved rounds."""
    ports = [free_port() for _ in range(4)]
    pre, dec = local_urls(ports[:2]), local_urls(ports[2:])
    stubs = start_stubs(tmp, ports)
    variants = {name: extra[2:] for name, extra in HERD_VARIANTS[1:]}
    procs, urls = {}, {}
    out: dict = {"rate": rate, "duration_s": duration, "rounds": rounds}
    try:
        for name, extra in variants.items():
            port = free_port()
            procs[name] = start_proxy(tmp, f"lat-{len(procs)}", pre, dec, port, "--policy", "jsq", *W4, *extra)
            urls[name] = f"http://127.0.0.1:{port}"
        time.sleep(1.0)
        lat: dict = {k: [] for k in variants}
        for _ in range(rounds):
            for name in variants:
                res = lg.split(tmp, [urls[name]], rate, duration)
                lat[name] += res["lat_s"]
                out.setdefault(f"errors[{name}]", 0)
                out[f"errors[{name}]"] += res["errors"]
        for name in variants:
            out[f"p50_ms[{name}]"] = float(np.percentile(lat[name], 50) * 1e3)
            out[f"p99_ms[{name}]"] = float(np.percentile(lat[name], 99) * 1e3)
        # /metrics is answered by whichever of the 4 processes takes the connection: one process's counts
        for name in list(variants)[1:]:
            out[f"reservations_one_process[{name}]"] = dict(metrics(urls[name]).get(
                "eldr_proxy_state_reservations_total", []))
    finally:
        for p in [*procs.values(), stubs]:
            stop(p)
    return out


def _parse(argv):
    ap = parser(__doc__, "bench-results/state.json")
    ap.add_argument("--parts", default="sign,cpu,herd,latency", help="comma-separated parts to run")
    ap.add_argument("--rate", type=float, default=200.0, help="req/s of the cpu and latency parts")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per round and row")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (the order alternates)")
    ap.add_argument("--before", default=None, help="the commit the cpu part compares with (default: the merge-base "
                                                   "with main)")
    ap.add_argument("--bursts", type=int, default=8)
    ap.add_argument("--burst-size", type=int, default=16)
    ap.add_argument("--burst-gap-s", type=float, default=0.5)
    ap.add_argument("--herd-rounds", type=int, default=2)
    ap.add_argument("--herd-workers", default=None, help="replica counts to compare with one proxy, e.g. 2,4,8")
    ap.add_argument("--herd-policy", default="jsq", help="the proxies' policy in the herd part (jsq, eldr, eldr-live)")
    return ap.parse_args(argv)


def _print_sign(sign: dict) -> None:
    print("signing, CPU us per message (median of 3):")
    print(f"  {'workers':<10}{'seal':>7}{'open':>7}{'unsigned':>10}{'added':>7}{'2xHMAC':>8}{'bytes':>7}")
    for k, v in sign.items():
        print(f"  {k:<10}{v['seal_us']:>7.2f}{v['open_us']:>7.2f}"
              f"{v['unsigned_publish_us'] + v['unsigned_receive_us']:>10.2f}{v['added_us']:>7.2f}"
              f"{2 * v['hmac_us']:>8.2f}{v['message_bytes']:>7}")


def _print_cpu(cpu: dict, rate: float) -> None:
    for k, v in cpu.items():
        if k.startswith(("median_us", "ratio")):
            print(f"2 replicas, CPU per request at {rate:g} req/s: {k} = {v:.3f}")
        elif k.startswith("paired_ratio"):
            print(f"2 replicas, CPU per request at {rate:g} req/s: {k} = {v['mean']:.3f} "
                  f"(95% CI {v['ci95'][0]:.3f}..{v['ci95'][1]:.3f}; rounds {v['per_round']})")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    parts = set(args.parts.split(","))
    env = environment()
    tmp = Path(tempfile.mkdtemp(prefix="bench-state-"))
    result: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())}}
    if "sign" in parts:
        result["sign"] = bench_sign()
        _print_sign(result["sign"])
    if "cpu" in parts:
        result["cpu"] = bench_cpu(tmp, args.rate, args.duration, args.rounds, args.before)
        _print_cpu(result["cpu"], args.rate)
    if "herd" in parts:
        result["herd"] = bench_herd(tmp, args)
        for k, v in result["herd"].items():
            if k.startswith("spread_max_ratio"):
                print(f"herd: {k} = {v}")
    if "latency" in parts:
        result["reserve_latency"] = bench_reserve_latency(tmp, args.rate, args.duration, args.rounds)
        print("reservation latency:", json.dumps(result["reserve_latency"], indent=1))
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    out = write_result(args.out, result, env)
    print(f"wrote {out}  (load average {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']})")


if __name__ == "__main__":
    main()
