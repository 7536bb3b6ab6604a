"""What eldr's decode router costs inside NVIDIA Dynamo (issue 38): per-request latency through Dynamo's own
frontend with eldr's router (eldr-live) as the decode tier vs the frontend's own decode routing (round-robin)
straight to the decode workers. MEASURED on this machine's CPU with STUB engines (no model: the prefill
answers one token and a signature, the decode streams tokens without delay), so the difference is the hop
through eldr's component plus its decision, not a serving gain.

Both deployments run at once (Dynamo 1.6.1 frontend, file discovery, stub workers on Dynamo's runtime); the
requests alternate between them in a seeded random order per pair, one at a time, so both see the same
machine load. Per round (one seed): the mean of the paired differences (eldr - Dynamo) of time to first
token and of the whole request; over rounds: their mean and a 95% t-interval. Decision time: the decision
log's ``decision_us`` (eldr-live's decision, inside the component).

Usage: ``.venv-dynamo/bin/python -m benchmarks.bench_dynamo [--rounds 5] [--pairs 100]``; prints a table,
writes bench-results/dynamo.json. Needs ``make venv-dynamo``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eldr_cli.testing.dynamo import MODEL, DynamoCluster, dynamo_missing

ROOT = Path(__file__).resolve().parents[1]


def build_routing(out: Path, decoders: int):
    """A GENERATED trace (4 layers, 16 experts) and its fit: the routing artifact the router serves."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    write_trace(out / "trace", synthetic_trace(n_requests=240, num_layers=4, num_experts=16, top_k=4, seed=0))
    return run_fit(out / "trace", out / "fit", decoders=decoders, pairs=2000, figures=False)

WORDS = "hello world the a an of to and is in it you that he was for on are with as his they be at one".split()


def one(client, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(time to first token, whole request) in ms of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                             "max_tokens": max_tokens, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    t1 = time.perf_counter()
    return ((first or t1) - t0) * 1e3, (t1 - t0) * 1e3


def hop_probe(pairs: int, seed: int) -> None:
    """(Run inside a deployment's environment.) Paired through Dynamo's runtime, no frontend: the same decode
    request (a prefill result with a signature) sent to the decode endpoint directly and through eldr's
    router; prints one JSON line of [direct, via eldr] whole-request times in ms."""
    import asyncio

    from dynamo.runtime import DistributedRuntime

    from eldr_cli.testing.dynamo_workers import prefill_answer

    async def main() -> None:
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        direct = await rt.endpoint("eldr-decode.backend.generate").client()
        eldr = await rt.endpoint("dynamo.eldr.generate").client()
        await direct.wait_for_instances()
        await eldr.wait_for_instances()
        rng = np.random.default_rng(seed)

        async def once(client) -> float:
            ids = [int(x) for x in rng.integers(5, 200, size=int(rng.integers(4, 40)))]
            req = {"token_ids": ids, "stop_conditions": {"max_tokens": 2},
                   "prefill_result": prefill_answer(ids, (4, 16))}
            t0 = time.perf_counter()
            async for _ in await client.random(req):
                pass
            return (time.perf_counter() - t0) * 1e3

        for _ in range(20):
            await once(direct)
            await once(eldr)
        out = []
        for _ in range(pairs):
            order = [("direct", direct), ("eldr", eldr)]
            if rng.random() < 0.5:
                order.reverse()
            got = {name: await once(c) for name, c in order}
            out.append([got["direct"], got["eldr"]])
        print(json.dumps(out), flush=True)
        rt.shutdown()

    asyncio.run(main())


def interval(x: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% t-interval (eldr_cli.stats.mean_ci); NaN bounds with fewer than two values."""
    from eldr_cli.stats import mean_ci

    iv = mean_ci([float(v) for v in x])
    if iv is None:
        return float("nan"), float("nan"), float("nan")
    nan = float("nan")
    return iv.mean, iv.lo if iv.lo is not None else nan, iv.hi if iv.hi is not None else nan


def run(rounds: int, pairs: int, max_tokens: int, tmp: Path) -> dict:
    import httpx

    routing = build_routing(tmp / "routing", decoders=3)
    eldr = DynamoCluster(tmp / "eldr", routing=routing, n_decode=3, delay_ms=0)
    base = DynamoCluster(tmp / "dynamo", routing=None, n_decode=3, routers=0, delay_ms=0)
    try:
        eldr.wait_ready()
        base.wait_ready()
        per_round = []
        # TCP_NODELAY: httpx writes a request's headers and body apart; with Nagle on, the body waits for the
        # server's delayed ACK (40 ms here) whichever deployment answers
        nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(timeout=60, transport=nodelay) as client:
            for c in (eldr, base):  # warm both paths
                for _ in range(20):
                    one(client, c.url, "hello world", max_tokens)
            for seed in range(rounds):
                rng = np.random.default_rng(seed)
                d_ttft, d_total, raw = [], [], {"eldr": [], "dynamo": []}
                for _ in range(pairs):
                    prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 40))))
                    order = [("eldr", eldr), ("dynamo", base)]
                    if rng.random() < 0.5:
                        order.reverse()
                    got = {name: one(client, c.url, prompt, max_tokens) for name, c in order}
                    d_ttft.append(got["eldr"][0] - got["dynamo"][0])
                    d_total.append(got["eldr"][1] - got["dynamo"][1])
                    for k in got:
                        raw[k].append(got[k])
                q = {f"{k}_ttft_ms_p10_p50_p90": np.percentile([x[0] for x in v], [10, 50, 90]).tolist()
                     for k, v in raw.items()}
                per_round.append({"seed": seed, **q, "ttft_diff_ms": float(np.mean(d_ttft)),
                                  "total_diff_ms": float(np.mean(d_total)),
                                  "eldr_ttft_ms_median": float(np.median([x[0] for x in raw["eldr"]])),
                                  "dynamo_ttft_ms_median": float(np.median([x[0] for x in raw["dynamo"]])),
                                  "eldr_total_ms_median": float(np.median([x[1] for x in raw["eldr"]])),
                                  "dynamo_total_ms_median": float(np.median([x[1] for x in raw["dynamo"]]))})
        hop = []
        for seed in range(rounds):
            r = subprocess.run([sys.executable, "-m", "benchmarks.bench_dynamo", "--hop-probe", str(pairs),
                                "--seed", str(seed)], cwd=ROOT,
                               env=eldr.env, capture_output=True, text=True, timeout=600)
            line = next((x for x in r.stdout.splitlines() if x.startswith("[")), None)
            if line is None:
                raise RuntimeError(f"hop probe failed: {r.stderr[-2000:]}")
            hop.append(np.array(json.loads(line)))
        rows = eldr.decisions(at_least=rounds * pairs)
        dec_us = np.array([r["decision_us"] for r in rows], dtype=float)
        assert {r["signature"] for r in rows} == {"ok"}, "every request should carry its signature"
    finally:
        eldr.close()
        base.close()
    return {"label": "MEASURED", "engines": "stub (no model)", "cpu_only": True, "rounds": rounds,
            "pairs_per_round": pairs, "max_tokens": max_tokens, "policy": "eldr-live",
            "baseline": "Dynamo frontend's own decode routing (round-robin) straight to the decode workers",
            "per_round": per_round,
            "hop_diff_ms": interval(np.array([float(np.mean(h[:, 1] - h[:, 0])) for h in hop])),
            "hop_direct_ms_median": float(np.median(np.concatenate([h[:, 0] for h in hop]))),
            "hop_eldr_ms_median": float(np.median(np.concatenate([h[:, 1] for h in hop]))),
            "ttft_diff_ms": interval(np.array([r["ttft_diff_ms"] for r in per_round])),
            "total_diff_ms": interval(np.array([r["total_diff_ms"] for r in per_round])),
            "decision_us": {"n": int(dec_us.size), "median": float(np.median(dec_us)),
                            "p99": float(np.percentile(dec_us, 99))}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pairs", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench-results" / "dynamo.json"))
    p.add_argument("--hop-probe", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hop_probe is not None:
        hop_probe(a.hop_probe, a.seed)
        return
    why = dynamo_missing()
    if why:
        sys.exit(why)
    with tempfile.TemporaryDirectory(prefix="bench-dynamo-") as tmp:
        res = run(a.rounds, a.pairs, a.max_tokens, Path(tmp))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"MEASURED, stub engines, CPU: {a.rounds} rounds x {a.pairs} paired requests, {a.max_tokens} tokens each")
    print(f"{'':34s}{'mean':>10s}{'95% CI':>22s}")
    for key, name in (("ttft_diff_ms", "added time to first token (ms)"), ("total_diff_ms", "added request time (ms)")):
        m, lo, hi = res[key]
        print(f"{name:34s}{m:10.2f}   [{lo:7.2f}, {hi:7.2f}]")
    m, lo, hi = res["hop_diff_ms"]
    print(f"{'added by the eldr hop, runtime (ms)':34s}{m:10.2f}   [{lo:7.2f}, {hi:7.2f}]   "
          f"(median {res['hop_direct_ms_median']:.2f} direct, {res['hop_eldr_ms_median']:.2f} via eldr)")
    for side in ("dynamo", "eldr"):
        q = np.median([r[f"{side}_ttft_ms_p10_p50_p90"] for r in res["per_round"]], axis=0)
        print(f"{side + ' TTFT p10/p50/p90 (ms)':34s}{q[0]:10.2f} {q[1]:8.2f} {q[2]:8.2f}")
    d = res["decision_us"]
    print(f"{'eldr-live decision (us)':34s}{d['median']:10.1f}   p99 {d['p99']:.1f}  (n={d['n']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
