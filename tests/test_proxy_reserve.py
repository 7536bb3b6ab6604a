"""Atomic select-and-reserve (the herd): replicas that decide at the same instant still spread their
requests, slots are given back, and forged reservations move a choice only among near-least-loaded
workers. Real redis-server, real in-process proxies, stub workers."""

from __future__ import annotations

import threading

import httpx
import pytest
import redis as redis_py
from _proxy_util import until as _until

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.proxy.replicas.reserve import TRUST_MARGIN as SLACK
from eldr_cli.proxy.replicas.reserve import reserve_decode
from eldr_cli.routing import Decision
from eldr_cli.routing.policies import Ranking
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "twVifMMFRcu3cMI8JS-VhOZ9_r2DnlDjopCSJg_W_fo"  # strong enough to derive the state key


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as r:
        r.free_dbs = iter(range(1, 16))  # a database (and channel names) per test
        yield r


def _replicas(redis, reserve_ms: float, policy: str = "jsq", routing=None):
    """Two replicas over one Redis database in front of one prefill and two slow decode stubs."""
    url = f"redis://{redis.host}:{redis.port}/{next(redis.free_dbs)}"
    stubs = [StubWorker("p0")] + [StubWorker(f"d{i}", token_delay_s=0.05) for i in range(2)]
    servers = [ServerThread(s).start() for s in stubs]
    pre, dec = [servers[0].url], [s.url for s in servers[1:]]
    reps = []
    for _ in range(2):
        cfg = ProxyConfig(prefill=pre, decode=dec, policy=policy, routing=routing, state=url, admin_token=TOKEN,
                          health_interval_s=0, state_reserve_ms=reserve_ms).validate()
        app = create_app(cfg)
        reps.append((app, ServerThread(app).start()))
    return url, reps, stubs[1:], dec, servers


def _stop_all(reps, servers):
    for _, s in reps:
        s.stop()
    for s in servers:
        s.stop()


@pytest.fixture
def cluster(redis, request):
    url, reps, decoders, dec, servers = _replicas(redis, getattr(request, "param", 50.0))
    yield url, reps, decoders, dec
    _stop_all(reps, servers)




def _stream(url, i, out):
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "m", "prompt": f"r{i}", "max_tokens": 30, "stream": True}) as r:
        for _ in r.iter_bytes():
            pass
        out.append(r.status_code)


def _burst(reps, decoders):
    (a, sa), (b, sb) = reps
    assert _until(lambda: a.state.shared.live_replicas == 2 and b.state.shared.live_replicas == 2)
    out: list = []
    ts = [threading.Thread(target=_stream, args=(s.url, i, out)) for i in range(8) for s in (sa, sb)]
    for t in ts:
        t.start()
    assert _until(lambda: sum(d.running for d in decoders) == 16, 10)
    return ts, out


@pytest.mark.parametrize("cluster", [1000.0], indirect=True)  # a deadline no answer misses, even here
def test_a_burst_on_two_replicas_is_spread_evenly(cluster):
    _, reps, decoders, _ = cluster
    _burst_is_spread_and_reserved(reps, decoders, 2)


def _burst_is_spread_and_reserved(reps, decoders, bound: int) -> None:
    ts, out = _burst(reps, decoders)
    assert abs(decoders[0].running - decoders[1].running) <= bound, [d.running for d in decoders]
    for t in ts:
        t.join()
    assert out == [200] * 16
    assert sum(app.state.shared.reserver.results["ok"] for app, _ in reps) == 16


def test_eldr_live_replicas_reserve_too_and_a_burst_is_spread(redis, tmp_path):
    """eldr-live goes through the same atomic reservation (its order of preference, its load cap as the
    slack): every request of a burst on two replicas is reserved, the burst stays within the load cap plus
    the other replica's lag, and every slot is given back."""
    from _proxy_util import build_routing

    routing = str(build_routing(tmp_path, decoders=2))
    url, reps, decoders, _, servers = _replicas(redis, 1000.0, policy="eldr-live", routing=routing)
    try:
        assert all(app.state.router.name == "eldr-live" for app, _ in reps)
        # Redis reserves the first decoder in eldr-live's order whose slots over both replicas are within the
        # slack (the load cap, max(2, ceil(25% of a mean <= 8)) = 2) of the least: after the reservation at most
        # 2 + 1 apart, whatever the replicas' lag (issue 31: was 4, which allowed 10/6 of 16). Issue 27 reworks
        # the reservation; this bound is the cap's arithmetic, so keep it in step with the slack if that changes.
        _burst_is_spread_and_reserved(reps, decoders, 3)
        r = redis_py.Redis.from_url(url)
        assert _until(lambda: not r.hgetall(f"{reps[0][0].state.shared.ns}:reserved"), 3)
        r.close()
        # each replica's live set empties once its own finishes ran and the other's empty vectors arrived
        assert _until(lambda: all(app.state.router.policy.is_empty() for app, _ in reps), 5)
    finally:
        _stop_all(reps, servers)


def test_redis_counts_every_slot_even_late_ones_and_gets_them_all_back(cluster):
    url, reps, decoders, dec = cluster
    ns = reps[0][0].state.shared.ns
    r = redis_py.Redis.from_url(url)

    def reserved():
        per = dict.fromkeys(dec, 0)
        for f, v in r.hgetall(f"{ns}:reserved").items():
            per[f.decode().split("|", 2)[2]] += int(v)
        return [per[u] for u in dec]

    ts, out = _burst(reps, decoders)  # with the default deadline: on a busy machine some answers are late
    assert _until(lambda: reserved() == [d.running for d in decoders], 3), (reserved(), [d.running for d in decoders])
    for t in ts:
        t.join()
    assert out == [200] * 16
    assert _until(lambda: not r.hgetall(f"{ns}:reserved"), 3)  # all given back
    r.close()


def test_forged_reservations_move_a_choice_only_among_near_least_loaded(cluster):
    url, reps, _, dec = cluster
    (a, sa), _ = reps
    r = redis_py.Redis.from_url(url)
    (b, _) = reps[1]
    assert _until(lambda: b.state.shared.replica_id in a.state.shared._others)  # B's signed state verified on A
    try:  # the attacker makes d0 look full in Redis (reservations are not signed), under a live replica's name
        # (a name with no signed heartbeat counts nothing; issue 28): counted up to B's signed load there + SLACK
        r.hset(f"{a.state.shared.ns}:reserved", f"{b.state.shared.replica_id}|decode|{dec[0]}", 1000)

        w1 = a.state.decode.find(dec[1])

        async def choose(extra):  # d1 carries `extra` more requests in the signed counts than d0
            w1.remote_inflight = extra - w1.inflight
            jsq_ranking = Ranking(0, slack=0, candidates=(0, 1))
            d, loads = Decision(0, "unused", ranking=jsq_ranking), a.state.decode.loads()
            choice, slot = await reserve_decode(a.state.shared.reserver, a.state.router.reservation(d, loads),
                                                a.state.decode, d, loads)
            a.state.shared.reserver.release(slot)
            return choice.worker

        assert sa.call(choose(SLACK)) == 1  # d1 is within SLACK of the least signed load: allowed
        assert sa.call(choose(SLACK + 1)) == 0  # d1 is not: d0 is the only candidate
    finally:
        r.close()


def test_with_costs_redis_redoes_the_rule_on_exact_counts(cluster):
    """A cost-aware offer (eldr-live's): among the workers within the slack of the least reserved, Redis takes the
    least predicted cost corrected by its growth for each slot the decision's loads did not see; without costs,
    the first in order within the slack. The slots are real reservations of this replica (a value forged into
    its own field counts only up to the slots it holds: the last case)."""
    from eldr_cli.proxy.replicas.reserve import Costs, Slot

    url, reps, _, dec = cluster
    (a, sa), _ = reps
    rv = a.state.shared.reserver
    keys = [f"decode|{u}" for u in dec] + ["decode|http://127.0.0.1:9"]  # a third worker: only its key matters
    r = redis_py.Redis.from_url(url)
    ns = a.state.shared.ns

    async def release(slots):
        for k in slots:
            rv.release(Slot(k))

    def pick(slots, costs=None, slack=2, forge=None):
        held = []
        for k, n in zip(keys, slots, strict=True):
            for _ in range(n):
                i, late = sa.call(rv.choose([k]))
                assert i == 0 and late is None
                held.append(k)
        if forge is not None:  # an attacker's value in this replica's own field
            r.hset(f"{ns}:reserved", f"{a.state.shared.replica_id}|{keys[forge]}", 1000)
        i, late = sa.call(rv.choose(keys, slack, costs))
        assert late is None
        r.delete(f"{ns}:reserved")
        sa.call(release([*held, keys[i]]))
        assert _until(lambda: not rv.held)
        return i

    try:
        cheap_first = Costs([1.0, 1.5, 1.6], [1.0, 0.1, 0.1], [0, 0, 0], 0.0)
        # the decision saw 0 everywhere; Redis has 2 on worker 0: 1.0 + 2 x 1.0 = 3.0 > 1.5, so worker 1
        assert pick([2, 0, 0], cheap_first) == 1
        assert pick([2, 0, 0]) == 0  # the old rule: the first within the slack, whatever it costs now
        # the decision had seen those 2 slots (seen = 2): its cost stands and worker 0 is still the cheapest
        assert pick([2, 0, 0], cheap_first._replace(seen=[2, 0, 0])) == 0
        # the cap: 3 slots on worker 0 are over the least (0) + slack 2, however cheap it looks
        assert pick([3, 0, 0], cheap_first._replace(seen=[3, 0, 0])) == 1
        # ties (within `tie` of the least) go to fewer slots: 1.5 and 1.6 tie at 10%, worker 2 holds none
        assert pick([3, 1, 0], cheap_first._replace(seen=[3, 1, 0], tie=0.1)) == 2
        assert pick([3, 1, 0], cheap_first._replace(seen=[3, 1, 0])) == 1
        # 1000 forged into this replica's own field of worker 0 counts as its 0 slots there plus the one
        # reservation on its way (1): worker 0 (first in order) is within slack 1 of 0 and keeps the request
        # (uncapped, 1000 would send it to worker 1)
        assert pick([0, 0, 0], forge=0, slack=1) == 0
    finally:
        r.delete(f"{ns}:reserved")
        r.close()


def test_eldr_live_replicas_see_each_others_live_sets(redis, tmp_path):
    """eldr-live's per-decoder vectors ride the signed counts: replica B's view of the others plus its own
    equals what one proxy holding every request would hold."""
    import contextlib

    from _proxy_util import build_routing

    routing = build_routing(tmp_path, decoders=2)
    url = f"redis://{redis.host}:{redis.port}/{next(redis.free_dbs)}"
    stubs = [ServerThread(StubWorker("p0")).start()] + \
            [ServerThread(StubWorker(f"d{i}", token_delay_s=0.05)).start() for i in range(2)]
    reps = []
    try:
        for _ in range(2):
            cfg = ProxyConfig(prefill=[stubs[0].url], decode=[s.url for s in stubs[1:]], policy="eldr-live",
                              routing=str(routing), state=url, admin_token=TOKEN, health_interval_s=0).validate()
            app = create_app(cfg)
            reps.append((app, ServerThread(app).start()))
        (a, sa), (b, sb) = reps
        pa, pb = a.state.router.policy, b.state.router.policy
        assert _until(lambda: b.state.shared.live_replicas == 2)
        with httpx.Client(timeout=30) as c, contextlib.ExitStack() as stack:
            for i in range(3):
                r = stack.enter_context(c.stream("POST", sa.url + "/v1/completions", json={
                    "model": "m", "prompt": f"held {i} " + "w " * (5 * i), "max_tokens": 60, "stream": True}))
                lines = r.iter_lines()
                next(lines)
                stack.callback(lines.close)
            assert pa.live.counts.sum() == 3
            assert _until(lambda: (pb.live.remote == pa.live.counts).all()
                          and (pb.live.counts + pb.live.remote).sum() == 3, 3), (pb.live.remote, pa.live.counts)
        assert _until(lambda: not pb.live.remote.any(), 5)  # finished requests leave the others' view too
    finally:
        for _, s in reps:
            s.stop()
        for s in stubs:
            s.stop()
