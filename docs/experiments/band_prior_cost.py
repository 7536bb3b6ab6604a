"""What eldr-live's band prior costs per request, on bench_routing's GENERATED fixture (issue 35).

An experiment, not part of eldr. K=16, L=48, E=128, 20 kept layers, 64 requests in flight per decoder
(``benchmarks.base.decisions``), the band prior's weight 0 and 0.5 on the same fixture: CPU time of the calling
thread (median and p99 over 3,000 calls) of a request's entry from its counts (Eq. 2, the prediction and, with
the weight, its prior: ``PrefillPredictor.entry``), and of the decision on a kept entry with the live set
refreshed first (``EldrLivePolicy.rank``; each request then dispatched where decided and that decoder's
oldest one finished)::

    python docs/experiments/band_prior_cost.py
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from benchmarks.base.decisions import INFLIGHT, E, K, L, build
from eldr_cli.routing import make_router


def _cpu(fn, n: int) -> tuple[float, float]:
    ts = []
    for i in range(n):
        t = time.thread_time_ns()
        fn(i)
        ts.append(time.thread_time_ns() - t)
    ts.sort()
    return ts[n // 2] / 1e3, ts[int(n * 0.99)] / 1e3


def measure(model, reqs: list, n: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(entry, decision) CPU p50 and p99 in us on ``model`` (its band prior as set)."""
    router = make_router("eldr-live", K, model=model)
    pol, loads, live = router.policy, [INFLIGHT] * K, [[] for _ in range(K)]
    for k in range(K):
        for i in range(INFLIGHT):
            d = router.decide(reqs[i % 64], loads, tokens=1500)
            router.on_dispatch(dataclasses.replace(d, worker=k), (k, i))
            live[k].append((k, i))
    entry = _cpu(lambda i: pol.request(reqs[i % 64]), n)
    entries = [pol.request(r) for r in reqs]

    def decide(i):
        r = pol.rank(loads, entries[i % 64], tokens=1500)
        pol.on_dispatch(r.first, ("t", i), r.detail)
        live[r.first].append(("t", i))
        pol.on_finish(r.first, live[r.first].pop(0))

    return entry, _cpu(decide, n)


def main(n: int = 3000) -> int:
    rng = np.random.default_rng(0)
    model = build(rng)
    reqs = [np.stack([rng.multinomial(2400, rng.dirichlet(np.full(E, 0.3))) for _ in range(L)]) for _ in range(64)]
    print(f"{'weight':>6} {'entry CPU p50/p99 (us)':>24} {'decision CPU p50/p99 (us)':>27}")
    for weight in (0.0, 0.5, 0.0, 0.5):  # alternated
        model.band_prior = weight
        entry, dec = measure(model, reqs, n)
        print(f"{weight:>6g} {entry[0]:>11.1f} / {entry[1]:<10.1f} {dec[0]:>13.1f} / {dec[1]:<10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
