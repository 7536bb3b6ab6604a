"""The decode-decision fixture of bench_routing and bench_shadow (issue 21's size: K=16 decoders, L=48 MoE
layers, E=128 experts, 20 kept layers, 32 decode-activation prototypes, 64 requests in flight per decoder),
and per-call wall and CPU timing."""

from __future__ import annotations

import time

import numpy as np

L, E, K, KEPT, M, INFLIGHT = 48, 128, 16, 20, 32, 64


def build(rng):
    from eldr_cli.routing import RoutingModel

    mask = np.arange(0, 2 * KEPT, 2)
    d = KEPT * E
    cent = rng.random((K, d))
    cent /= np.linalg.norm(cent, axis=1, keepdims=True)
    protos = rng.random((M, d))
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    act = np.clip(rng.dirichlet(np.full(E, 0.3), size=(M + 1, L)) * 8, 0, 0.999).astype(np.float32)
    # eldr-live's per-request predictor (issue 35): the prototype's mean shrunk toward the request's own prefill
    # distribution on every layer (the fit keeps kappa = inf where the prototype alone predicts better)
    shrink = (np.full(L, 32.0), np.full(L, 0.5))
    # and its band prior under load (every decision here is under load: the prior's cost is in each one)
    from eldr_cli.routing.live import BAND_PRIOR

    return RoutingModel("count-idf", rng.random((L, E)) + 0.1, mask, cent, tau=0.1, live=(protos, act),
                        live_shrinkage=shrink, top_k=8, band_prior=BAND_PRIOR)


def percentiles(ns: list[int]) -> dict:
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99))}


def time_calls(fn, n: int, between=None) -> tuple[dict, dict]:
    """Wall and CPU percentiles of ``fn(i)``; ``between(i, result)`` runs untimed after each call."""
    wall, cpu = [], []
    pc, tc = time.perf_counter_ns, time.thread_time_ns
    for i in range(n):
        w0, c0 = pc(), tc()
        res = fn(i)
        cpu.append(tc() - c0)
        wall.append(pc() - w0)
        if between is not None:
            between(i, res)
    return percentiles(wall), percentiles(cpu)
