"""The decision as a value and dispatch before any await (issue 27): a request is in the router's live set and
its decoder's load from its decision on, whatever awaits follow; the decision log and metrics name the worker
used and the ranking's first choice; replicas' summed live sets equal one proxy's. Real redis-server, real
in-process proxies, stub workers; the slow reservation is a fault injected into one replica's reserver."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest
import redis as redis_py
from _proxy_util import build_routing
from _proxy_util import until as _until

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.routing import make_router
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "0bq5mBSE3xkTq9ZzYlJbGRvFRp2sNLp0xWcJc1f2X9E"  # with --state, the admin token signs: 256 bits (issue 28)


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as r:
        r.free_dbs = iter(range(1, 16))
        yield r




def _stream(url, i, out):
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "m", "prompt": f"r{i} " + "w " * i, "max_tokens": 4, "stream": True}) as r:
        for _ in r.iter_bytes():
            pass
        out.append((r.status_code, r.headers.get("x-eldr-decode-worker")))


def _one_replica(redis, tmp_path, policy, **cfg):
    url = f"redis://{redis.host}:{redis.port}/{next(redis.free_dbs)}"
    servers = [ServerThread(StubWorker("p0")).start()] + \
              [ServerThread(StubWorker(f"d{i}", token_delay_s=0.02)).start() for i in range(2)]
    routing = str(build_routing(tmp_path, decoders=2)) if policy != "jsq" else None
    conf = ProxyConfig(prefill=[servers[0].url], decode=[s.url for s in servers[1:]], policy=policy, routing=routing,
                       state=url, admin_token=TOKEN, health_interval_s=0, state_reserve_ms=1000, **cfg).validate()
    app = create_app(conf)
    return url, app, ServerThread(app).start(), servers


def test_the_live_set_and_the_loads_hold_requests_waiting_on_a_slow_reservation(redis, tmp_path):
    """Four requests of one replica decide while the reservation is held back: each later decision already sees
    the earlier ones (in eldr-live's live set and in the decoders' loads), before any decode leg has started."""
    _, app, srv, servers = _one_replica(redis, tmp_path, "eldr-live")
    rv = app.state.shared.reserver
    gate = threading.Event()
    seen: list[list[int]] = []
    pol = app.state.router.policy
    orig, rank = rv.choose, pol.rank

    async def slow_choose(cands, slack=0, costs=None):  # a slow Redis: held until the test opens the gate (bounded)
        for _ in range(1000):
            if gate.is_set():
                break
            await asyncio.sleep(0.01)
        return await orig(cands, slack, costs)

    def spy_rank(loads, *a, **kw):  # the loads each decision sees
        seen.append(list(loads))
        return rank(loads, *a, **kw)

    rv.choose = slow_choose
    pol.rank = spy_rank
    out: list = []
    ts = [threading.Thread(target=_stream, args=(srv.url, i, out)) for i in range(4)]
    try:
        for n, t in enumerate(ts):
            t.start()
            assert _until(lambda: len(seen) == n + 1)  # noqa: B023 - one decision at a time: a known order
        assert int(pol.live.counts.sum()) == 4  # in the live set from the decision on ...
        assert sum(w.inflight for w in app.state.decode.workers) == 4  # ... and in the decoders' loads
        assert [sum(ld) for ld in seen] == [0, 1, 2, 3]  # each decision saw the ones before it
        assert sum(s.app.running for s in servers[1:]) == 0  # no decode leg has started: all wait on Redis
        gate.set()
        for t in ts:
            t.join()
        assert [o[0] for o in out] == [200] * 4
        assert _until(lambda: pol.is_empty() and not any(w.inflight for w in app.state.decode.workers))
    finally:
        gate.set()
        srv.stop()
        for s in servers:
            s.stop()


def test_decision_log_and_metrics_name_the_worker_the_reservation_moved_to(redis, tmp_path):
    """Redis's counts make d0 look busier (3 slots written into this replica's own field, which count as the
    slots it holds there plus its reservations on their way: 1; since issue 28 another name's fields count only
    under a signed heartbeat): JSQ's first choice is d0 (slack 0), every request goes to d1; the log says d1 (the
    worker used) with d0 as 'first', and the decision counter counts d1."""
    log = tmp_path / "decisions.jsonl"
    url, app, srv, servers = _one_replica(redis, tmp_path, "jsq", decision_log=str(log))
    d0, d1 = (w.id for w in app.state.decode.workers)
    r = redis_py.Redis.from_url(url)
    try:
        me = app.state.shared.replica_id
        r.hset(f"{app.state.shared.ns}:reserved", f"{me}|decode|{app.state.decode.workers[0].url}", 3)
        out: list = []
        for i in range(3):
            _stream(srv.url, i, out)
        assert out == [(200, d1)] * 3
        app.decision_log.flush()
        rows = [json.loads(x) for x in log.read_text().splitlines()]
        assert [(x["worker"], x["first"]) for x in rows] == [(d1, d0)] * 3
        text = httpx.get(srv.url + "/metrics").text
        assert f'eldr_proxy_decisions_total{{policy="jsq",worker="{d1}"}} 3.0' in text
        counted = [x for x in text.splitlines() if x.startswith("eldr_proxy_decisions_total")]
        assert not [x for x in counted if f'worker="{d0}"' in x]
        assert 'eldr_proxy_decisions_moved_total{policy="jsq"} 3.0' in text
    finally:
        r.close()
        srv.stop()
        for s in servers:
            s.stop()


def test_a_reservation_naming_a_worker_that_left_is_decided_locally_and_counted(redis, tmp_path):
    """The reservation answers d0, but d0 was removed (admin API) while Redis was asked: the request goes to the
    worker left in the pool (the local decision on the pool of now; d0's old position would now name another
    worker or none), the answer is counted as departed, and its slot in Redis is given back."""
    url, app, srv, servers = _one_replica(redis, tmp_path, "jsq")
    d0, d1 = app.state.decode.workers
    rv = app.state.shared.reserver
    orig = rv.choose

    async def choose_then_remove(cands, slack=0, costs=None):
        i, late = await orig(cands, slack, costs)
        assert cands[i].endswith(d0.url)  # Redis chose d0 (all empty: the first in order) ...
        async with httpx.AsyncClient() as c:  # ... which leaves the pool before the answer is used
            r = await c.post(srv.url + "/admin/workers", json={"action": "remove", "role": "decode", "url": d0.url},
                             headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        return i, late

    rv.choose = choose_then_remove
    r = redis_py.Redis.from_url(url)
    try:
        out: list = []
        _stream(srv.url, 0, out)
        assert out == [(200, d1.id)]
        assert rv.results["departed"] == 1 and rv.results["ok"] == 0
        assert servers[1].app.stats["decode"] == 0 and servers[2].app.stats["decode"] == 1
        assert _until(lambda: not r.hgetall(f"{app.state.shared.ns}:reserved"), 3)  # the slot given back
        text = httpx.get(srv.url + "/metrics").text
        assert 'eldr_proxy_state_reservations_total{result="departed"} 1.0' in text
    finally:
        r.close()
        srv.stop()
        for s in servers:
            s.stop()


@pytest.mark.parametrize("own_prediction", [False, True])
def test_four_replicas_summed_live_sets_equal_one_proxys_after_any_sequence(tmp_path, own_prediction):
    """Dispatches, retries (a move to another decoder), cancels and finishes in random order, spread over 4
    replicas, against one router that sees every event: after merging, each replica's counts per prototype and
    tokens equal the one's; with the prototype predictor so do its idle probabilities; with the per-request
    (shrunk) prediction each replica holds its own requests by their own prediction and the others' by their
    prototype's mean, exactly (issue 35: what replicas share is counts that sum)."""
    from eldr_cli.routing import RoutingModel

    model = RoutingModel.load(build_routing(tmp_path, decoders=4))
    L0 = model.shape[0]
    model.live_shrinkage = (np.full(L0, 8.0), np.full(L0, 0.5)) if own_prediction else None
    one = make_router("eldr-live", 4, model=model)
    reps = [make_router("eldr-live", 4, model=model) for _ in range(4)]
    rng = np.random.default_rng(7)
    live: dict[int, tuple[int, int]] = {}  # request -> (replica, decoder)
    L, E = model.shape
    for i in range(400):
        op = rng.random()
        if op < 0.5 or not live:  # a new request: decided by its replica on the cluster's loads
            rep = int(rng.integers(4))
            counts = rng.integers(0, 3, size=(L, E))
            loads = [sum(1 for _, w in live.values() if w == k) for k in range(4)]
            d = reps[rep].decide(counts, loads, tokens=int(rng.integers(1, 50)))
            reps[rep].on_dispatch(d, i)
            one.on_dispatch(d, i)
            live[i] = (rep, d.worker)
        else:
            key = list(live)[int(rng.integers(len(live)))]
            rep, w = live[key]
            if op < 0.65:  # a retry: finished on w, dispatched again elsewhere with no await between
                d = reps[rep].decide(None, [0, 0, 0, 0], healthy=[k != w for k in range(4)])
                for r in (reps[rep], one):
                    r.on_finish(w, key)
                    r.on_dispatch(d, key)
                live[key] = (rep, d.worker)
            else:  # cancelled or finished
                reps[rep].on_finish(w, key)
                one.on_finish(w, key)
                del live[key]
        if i % 50 == 49:
            _merge(reps)
            for r in reps:
                pr, po = r.policy, one.policy
                lr, lo = pr.live, po.live
                assert ((lr.counts + lr.remote) == lo.counts).all()
                assert ((lr.tokens + lr.remote_tokens) == lo.tokens).all()
                if not own_prediction:
                    np.testing.assert_allclose(pr.idle_probabilities(), po.idle_probabilities(), rtol=1e-4,
                                               atol=1e-6)
                else:  # own requests by their own entries, the others' by their prototype's row of the table
                    exact = np.stack([np.exp(np.maximum(lr.exact_log_q(d), -60.0)) for d in range(4)])
                    np.testing.assert_allclose(pr.idle_probabilities(), exact, rtol=1e-4, atol=1e-6)
                    mine = [k for k, (rep, _) in live.items() if reps[rep] is r]
                    assert sorted(lr.where) == sorted(mine)


def _merge(reps):
    for w in range(4):
        vecs = [r.export_state(w) for r in reps]
        for j, r in enumerate(reps):
            others = [v for k, v in enumerate(vecs) if k != j]
            r.merge_state(w, [int(x) for x in np.sum(others, axis=0)])
