"""The decision log at 1,000 requests/s: what writing a row costs the request path, with and without the replay
fields, against writing it inline (the serialization and the write on the request path, as before the writer
thread). Rows are what the proxy writes for a Qwen3-30B-A3B-shaped signature (L=48, E=128, top-8, GENERATED
counts of a 300-token prompt) at K=16.

    .venv/bin/python -m benchmarks.bench_decision_log --out bench-results/decision_log.json
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from benchmarks.base import environment, parser, write_result
from eldr_cli.handoff import encode_counts
from eldr_cli.proxy.decisionlog import DecisionLog


def _row(rng, i: int, replay: bool, K: int = 16, L: int = 48, E: int = 128, k: int = 8, prompt: int = 300) -> dict:
    row = {"ts": time.time(), "request_id": f"{i:032x}", "policy": "jsq", "tau": 0.1, "signature": "ok",
           "similarities": rng.random(K).tolist(), "band": [0, 3], "predicted_ms": None,
           "loads": rng.integers(0, 64, K).tolist(), "chosen": 3, "worker": "d3", "domain": None,
           "decision_us": 21.5}
    if replay:
        p = rng.dirichlet(np.full(E, 0.3), size=L)
        counts = np.stack([rng.multinomial(prompt * k, p[l]) for l in range(L)])
        enc = encode_counts(counts)
        row.update({"log_v": 2, "arrival_s": time.time(), "prompt_tokens": prompt, "max_tokens": 256,
                    "sig": {x: enc[x] for x in ("shape", "dtype", "data")}, "routing_id": "0123456789abcdef"})
    return row


def _paced(mode: str, rows: list[dict], rate: float, path: Path) -> dict:
    """Send ``rows`` at ``rate``/s; time each write call (the part on the request path)."""
    log = DecisionLog(str(path)) if mode == "thread" else None
    fh = open(path, "ab", buffering=1 << 16) if mode == "inline" else None
    cost = np.empty(len(rows))
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        due = t0 + i / rate
        while time.perf_counter() < due:  # pace: a sleep would oversleep at 1 ms
            pass
        a = time.perf_counter()
        if log is not None:
            log.write(row)
        else:
            assert fh is not None
            fh.write(orjson.dumps(row) + b"\n")
        cost[i] = time.perf_counter() - a
    t_send = time.perf_counter() - t0
    if log is not None:
        log.flush()
        lag = time.perf_counter() - t0 - t_send
        dropped, written = log.dropped, log.written
        log.close()
    else:
        assert fh is not None
        fh.close()
        lag, dropped, written = 0.0, 0, len(rows)
    return {"mode": mode, "rows": len(rows), "rate_rps": rate, "achieved_rps": len(rows) / t_send,
            "write_p50_us": float(np.percentile(cost, 50) * 1e6), "write_p99_us": float(np.percentile(cost, 99) * 1e6),
            "write_max_us": float(cost.max() * 1e6), "drain_after_s": lag, "dropped": dropped, "written": written,
            "bytes_per_row": path.stat().st_size / max(written, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "bench-results/decision_log.json")
    ap.add_argument("--rate", type=float, default=1000.0, help="rows per second (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args(argv)
    env = environment()
    rng = np.random.default_rng(0)
    n = int(a.rate * a.seconds)
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            rows = [_row(rng, i, replay) for i in range(n)]
            for mode in ("inline", "thread"):
                r = _paced(mode, rows, a.rate, Path(tmp) / f"{mode}-{replay}.jsonl")
                res.append({"replay_fields": replay, **r})
    from eldr_cli.console import console, table

    t = table("replay", "mode", "req/s", "write p50 us", "p99 us", "max us", "drain s", "dropped", "B/row",
              title="decision-log writing at 1,000 req/s (wall time of the call on the request path)")
    for r in res:
        t.add_row(str(r["replay_fields"]), r["mode"], f"{r['achieved_rps']:.0f}", f"{r['write_p50_us']:.1f}",
                  f"{r['write_p99_us']:.1f}", f"{r['write_max_us']:.0f}", f"{r['drain_after_s']:.3f}",
                  str(r["dropped"]), f"{r['bytes_per_row']:.0f}")
    console.print(t)
    write_result(a.out, {"results": res}, env)


if __name__ == "__main__":
    main()
