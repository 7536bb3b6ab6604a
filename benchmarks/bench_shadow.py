"""Shadow mode's cost on the request path: what ``ShadowSet.decide`` adds to one decode decision (the shadows'
decisions on their own counterfactual state, their dispatch, the live and shadow predictors), at bench-routing's
size: K=16 decoders, L=48, E=128, 20 kept layers, 32 prototypes, 64 requests in flight per decoder on every
assignment. The live policy is JSQ; one shadow eldr-live (the issue's bound: <= 50 us p99), then two shadows
(eldr-live, eldr). Between timed calls the decoder's oldest request finishes (untimed, as in the proxy), so the
pending live-set updates are paid in the next call. Wall time per call swings with other processes on a shared
machine; CPU time of the thread is the code's own cost. GENERATED data.

    .venv/bin/python -m benchmarks.bench_shadow --out bench-results/shadow.json
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from benchmarks.base import environment, parser, write_result
from benchmarks.base.decisions import INFLIGHT, E, K, L, build, percentiles, time_calls


def _state(model):
    """What ShadowSet reads of the proxy's state: the decode pool, the routing model, the live router."""
    from eldr_cli.routing import make_router

    class Pool(list):
        workers: list

    pool = Pool(SimpleNamespace(id=f"d{k}", inflight=INFLIGHT, healthy=True) for k in range(K))
    pool.workers = list(pool)
    return SimpleNamespace(model=model, cost=None, decode=pool, tau_override=None, router=make_router("jsq", K),
                           make=lambda name, n, m, tau: make_router(name, n, model=m, tau=tau))


def bench(shadows: list[str], model, reqs, n: int) -> dict:
    from eldr_cli.proxy.shadow import ShadowSet

    st = _state(model)
    s = ShadowSet(st, shadows)
    loads = [INFLIGHT] * K
    healthy = [True] * K
    live: list[list] = [[] for _ in range(K)]
    order: list = []
    for i in range(K * INFLIGHT):  # fill: 64 in flight on every decoder, on every assignment
        d = st.router.decide(None, loads)
        d = type(d)(i % K, d.signature)
        rid = f"f{i}"
        s.decide(rid, reqs[i % len(reqs)], d, None, healthy, 1500)
        live[d.worker].append(rid)
        order.append(rid)

    def call(i):
        d = st.router.decide(None, loads)
        d = type(d)(i % K, d.signature)
        s.decide(f"t{i}", reqs[i % len(reqs)], d, None, healthy, 1500)
        return d

    def churn(i, d):
        live[d.worker].append(f"t{i}")
        s.finish(order.pop(0))  # the oldest request anywhere ends: every assignment gives it back
        order.append(f"t{i}")

    wall, cpu = time_calls(call, n, churn)
    return {"shadows": shadows, "wall": wall, "cpu": cpu, "calls": n, "path": _on_the_path(s, st, reqs, n)}


def _on_the_path(s, st, reqs, n: int) -> dict:
    """What the proxy's request path pays with shadows: ``ShadowSet.later`` (scheduling the shadows right
    after the dispatch), timed inside a running event loop; the shadows then run before the next call."""
    import asyncio
    import time

    async def run() -> list[int]:
        healthy = [True] * K
        ns = []
        for i in range(n):
            d = st.router.decide(None, [INFLIGHT] * K)
            d = type(d)(i % K, d.signature)
            t0 = time.perf_counter_ns()
            s.later(f"p{i}", reqs[i % len(reqs)], d, None, healthy, 1500, None, None)
            ns.append(time.perf_counter_ns() - t0)
            s.finish_later(f"p{i}")
            await asyncio.sleep(0)
        return ns

    return percentiles(asyncio.run(run()))


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "bench-results/shadow.json")
    ap.add_argument("--calls", type=int, default=5000, help="timed decisions with one shadow (default: %(default)s)")
    a = ap.parse_args(argv)
    env = environment()
    rng = np.random.default_rng(0)
    model = build(rng)
    reqs = [rng.poisson(0.5, size=(L, E)) for _ in range(256)]
    res = [bench(["eldr-live"], model, reqs, a.calls), bench(["eldr-live", "eldr"], model, reqs, a.calls // 2)]
    from eldr_cli.console import console, table

    t = table("shadows", "on the path p50/p99 us", "shadow work wall p50/p99 us", "cpu p50/p99 us",
              title="shadow cost per decode decision (K=16, L=48, E=128, 64 in flight per decoder; GENERATED)")
    for r in res:
        t.add_row(",".join(r["shadows"]), f"{r['path']['p50_us']:.1f} / {r['path']['p99_us']:.1f}",
                  f"{r['wall']['p50_us']:.1f} / {r['wall']['p99_us']:.1f}",
                  f"{r['cpu']['p50_us']:.1f} / {r['cpu']['p99_us']:.1f}")
    console.print(t)
    write_result(a.out, {"results": res, "bound_p99_us": 50}, env)


if __name__ == "__main__":
    main()
