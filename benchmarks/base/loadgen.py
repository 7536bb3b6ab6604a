"""The load generator of the serving benchmarks, in its own process (``python -m benchmarks.base.loadgen``):
open-loop Poisson arrivals through a router (``--mode proxy``) or the PD exchange sent to the workers
directly (``--mode direct``: the prefill leg, then the decode leg), or a closed-loop soak with injected
faults (``--mode soak``). :func:`run` and :func:`split` start it and read its result."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.base.env import PY, ROOT

PD_KTP = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def open_loop(args) -> dict:
    """Open-loop Poisson arrivals (or closed-loop soak). Runs in its own process."""
    import aiohttp

    rng = random.Random(args.seed)
    prompts = [f"prompt {i}: " + " ".join(f"word{(i * 31 + j) % 97}" for j in range(40)) for i in range(64)]
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=30)
    lat: list[float] = []
    errors = 0
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async def one_direct(body):
            pre = dict(body, stream=False, max_tokens=1, kv_transfer_params=PD_KTP)
            async with s.post(args.prefill + "/v1/completions", json=pre) as r:
                ans = await r.json()
            ktp = ans.get("kv_transfer_params")
            if isinstance(ktp, dict):
                ktp.pop("eldr_signature", None)
            async with s.post(args.decode + "/v1/completions", json=dict(body, kv_transfer_params=ktp)) as r:
                await r.read()
                return r.status

        async def one_proxy(body):
            async with s.post(args.url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        fn = one_direct if args.mode == "direct" else one_proxy

        async def timed(body):
            nonlocal errors
            t0 = time.perf_counter()
            try:
                st = await fn(body)
            except Exception as e:  # count, keep going
                st = type(e).__name__
            dt = time.perf_counter() - t0
            statuses[str(st)] = statuses.get(str(st), 0) + 1
            if st == 200:
                lat.append(dt)
            else:
                errors += 1

        # warm-up: open connections, fill caches
        await asyncio.gather(*(timed({"model": "m", "prompt": prompts[i % 64], "max_tokens": 8})
                               for i in range(64)))
        lat.clear()
        statuses.clear()
        errors = 0
        tasks = []
        t_start = time.perf_counter()
        t_next = t_start
        n = int(args.rate * args.duration)
        for i in range(n):
            t_next += rng.expovariate(args.rate)
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(timed({"model": "m", "prompt": prompts[i % 64], "max_tokens": 8})))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
    return {"n": n, "ok": len(lat), "errors": errors, "statuses": statuses, "wall_s": wall,
            "achieved_rps": len(lat) / wall, "lat_s": lat}


async def soak(args) -> dict:
    """Closed-loop soak with faults; returns per-kind client-side counts."""
    import aiohttp

    rng = random.Random(args.seed)
    kinds = [("ok", 0.80), ("prefill_500", 0.03), ("prefill_timeout", 0.01), ("decode_500", 0.03),
             ("decode_drop", 0.05), ("prefill_nosig", 0.02), ("disconnect", 0.06)]
    names = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    counts = {k: 0 for k in names}
    client = {"http_200": 0, "http_error": 0, "stream_error_event": 0, "disconnected": 0, "exceptions": 0}
    sent = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one(i):
            nonlocal sent
            kind = rng.choices(names, weights)[0]
            counts[kind] += 1
            stream = kind in ("decode_drop", "disconnect") or rng.random() < 0.5
            marker = f"[[fault:{kind}]] " if kind not in ("ok", "disconnect") else ""
            body = {"model": "m", "prompt": f"{marker}soak request {i % 500}", "max_tokens": 16, "stream": stream}
            sent += 1
            try:
                async with s.post(args.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        await r.read()
                        client["http_error"] += 1
                        return
                    if kind == "disconnect":
                        await r.content.readany()
                        r.close()  # the client goes away mid-stream
                        client["disconnected"] += 1
                        return
                    data = await r.read()
                    if stream and b'"error"' in data:
                        client["stream_error_event"] += 1
                    else:
                        client["http_200"] += 1
            except Exception:
                client["exceptions"] += 1

        q: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.n):
            q.put_nowait(i)

        async def worker():
            while not q.empty():
                await one(q.get_nowait())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return {"sent": sent, "kinds": counts, "client": client, "wall_s": wall}


def merge(acc, res):
    if acc is None:
        return dict(res, lat_s=list(res["lat_s"]), statuses=dict(res["statuses"]))
    acc["lat_s"] += res["lat_s"]
    acc["n"] += res["n"]
    acc["ok"] += res["ok"]
    acc["errors"] += res["errors"]
    acc["wall_s"] += res["wall_s"]
    acc["achieved_rps"] = acc["ok"] / acc["wall_s"]
    for k, v in res["statuses"].items():
        acc["statuses"][k] = acc["statuses"].get(k, 0) + v
    return acc


def pct(xs, q):
    return float(np.percentile(xs, q) * 1e3) if xs else float("nan")


def row(res, base):
    lat = res["lat_s"]
    r = {"ok": res["ok"], "errors": res["errors"], "achieved_rps": round(res["achieved_rps"], 1),
         "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    if base is not None:
        r["added_p50_ms"] = r["p50_ms"] - pct(base["lat_s"], 50)
        r["added_p99_ms"] = r["p99_ms"] - pct(base["lat_s"], 99)
    return r


def _cmd(out: Path, **kw) -> list[str]:
    return [PY, "-m", "benchmarks.base.loadgen", "--out", str(out), *(x for k, v in kw.items()
                                                                     for x in (f"--{k}", str(v)))]


def run(tmp: Path, mode: str, rate: float, duration: float, **kw) -> dict:
    """One load-generator process at ``rate`` req/s for ``duration`` s (``kw``: url, prefill, decode, seed);
    -> its result (latencies of the successful requests in ``lat_s``)."""
    out = tmp / f"lg-{mode}-{rate}-{time.monotonic_ns()}.json"
    subprocess.run(_cmd(out, mode=mode, rate=rate, duration=duration, **kw), check=True, cwd=ROOT)
    return json.loads(out.read_text())


def run_soak(url: str, n: int, out: Path, **kw) -> dict:
    """The closed-loop soak of ``n`` requests with injected faults against ``url`` (``kw``: seed, concurrency)."""
    subprocess.run(_cmd(out, mode="soak", url=url, n=n, **kw), check=True, cwd=ROOT)
    return json.loads(Path(out).read_text())


def split(tmp: Path, urls: list[str], rate: float, duration: float) -> dict | None:
    """One load-generator process per URL, each at rate/len(urls), run at the same time; pooled."""
    procs, outs = [], []
    for i, u in enumerate(urls):
        out = tmp / f"lg-{i}-{time.monotonic_ns()}.json"
        outs.append(out)
        procs.append(subprocess.Popen(_cmd(out, mode="proxy", url=u, rate=rate / len(urls), duration=duration,
                                           seed=i), cwd=ROOT))
    for p in procs:
        p.wait()
    acc = None
    for out in outs:
        acc = merge(acc, json.loads(out.read_text()))
    if acc is not None and len(urls) > 1:
        acc["wall_s"] /= len(urls)  # the runs were concurrent
        acc["achieved_rps"] = acc["ok"] / acc["wall_s"]
    return acc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("proxy", "direct", "soak"), default="proxy")
    ap.add_argument("--url", default="")
    ap.add_argument("--prefill", default="")
    ap.add_argument("--decode", default="")
    ap.add_argument("--rate", type=float, default=200)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    runner: Callable[..., Any]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    out = runner(soak(args) if args.mode == "soak" else open_loop(args))
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
