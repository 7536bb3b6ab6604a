"""Stub clusters of the serving benchmarks: stub workers (``eldr_cli.testing.stub_worker``) with the fake
prompt shape :data:`SHAPE`, a routing artifact fitted for that shape, ``eldr serve-proxy`` processes that
share one signing key, and the spread of requests running at the decoders."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

from benchmarks.base.env import BIN, PY
from benchmarks.base.procs import flags, spawn, stop
from eldr_cli.testing.servers import wait_http

SHAPE = (48, 128)  # the stub's fake prompt counts [L, E]; the routing artifact matches it
KEY = secrets.token_hex(32)  # the replicas' shared signing key, never a command-line value


def local_urls(ports: list[int]) -> list[str]:
    return [f"http://127.0.0.1:{p}" for p in ports]


def start_stubs(tmp: Path, ports: list[int], *extra: str, log: str = "stubs.log"):
    """One stub-worker process serving every port in ``ports``; returns once each answers /health (stopped
    again if one does not)."""
    p = spawn([PY, "-m", "eldr_cli.testing.stub_worker", *flags("--port", map(str, ports)),
               "--layers", str(SHAPE[0]), "--experts", str(SHAPE[1]), *extra], tmp / log)
    try:
        for x in ports:
            wait_http(f"http://127.0.0.1:{x}/health", 60, proc=p, log=tmp / log)
    except BaseException:
        stop(p)
        raise
    return p


def start_proxy(tmp: Path, name: str, pre: list[str], dec: list[str], port: int, *extra: str):
    """``eldr serve-proxy`` over ``pre`` and ``dec`` on ``port`` (``ELDR_STATE_KEY`` = :data:`KEY`)."""
    p = spawn([str(BIN / "eldr"), "serve-proxy", *flags("--prefill", pre), *flags("--decode", dec),
               "--port", str(port), "--log-level", "warning", *extra], tmp / f"{name}.log",
              env={"ELDR_STATE_KEY": KEY})
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 90, proc=p, log=tmp / f"{name}.log")
    except BaseException:
        stop(p)
        raise
    return p


def fit_routing(tmp: Path, decoders: int = 2) -> Path:
    """A routing artifact for the stub's fake prompt shape (K = ``decoders``), under ``tmp``."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    if not (tmp / "trace" / "manifest.json").exists():
        write_trace(tmp / "trace", synthetic_trace(300, SHAPE[0], SHAPE[1], 8, seed=0))
    return run_fit(tmp / "trace", tmp / f"fit{decoders}", decoders=decoders, pairs=2000, figures=False)


def sample_spread(decode_urls: list[str], stop: threading.Event, out: list[int], every_s: float = 0.05) -> None:
    """Append the spread (max - min) of requests running AT THE DECODERS (each stub's
    vllm:num_requests_running) every ``every_s`` until ``stop``: the ground truth, the same for every
    router, not any proxy's (possibly stale) view of it."""
    import httpx

    from eldr_cli.proxy.health import parse_running

    with httpx.Client(timeout=2) as c:
        while not stop.is_set():
            try:
                vals = [parse_running(c.get(u + "/metrics").text) for u in decode_urls]
                known = [v for v in vals if v is not None]
                if len(known) == len(vals):
                    out.append(max(known) - min(known))
            except httpx.HTTPError:
                pass
            time.sleep(every_s)
