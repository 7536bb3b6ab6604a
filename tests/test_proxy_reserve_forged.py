"""Reservation state that cannot lie (issue 28, item 3): the reservation counts in Redis are unsigned, so a
replica counts a field only while that replica's signed heartbeat is fresh (a bare key is no heartbeat),
only values in 0..MAX_IN_FLIGHT (others are ignored and counted), and the share of decisions forged slots
can move is bounded by SLACK (measured here as the spread at the decoders). Real redis-server, real
in-process proxies, stub decoders that hold their requests."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import orjson
import pytest
import redis as redis_py
from _proxy_util import until as _until

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.proxy.replicas.reserve import MAX_IN_FLIGHT
from eldr_cli.proxy.replicas.reserve import TRUST_MARGIN as SLACK
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "twVifMMFRcu3cMI8JS-VhOZ9_r2DnlDjopCSJg_W_fo"  # strong enough to derive the state key


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as r:
        yield r


_db = iter(range(1, 16))


@pytest.fixture
def cluster(redis, tmp_path):
    url = f"redis://{redis.host}:{redis.port}/{next(_db)}"
    stubs = [StubWorker("p0")] + [StubWorker(f"d{i}", token_delay_s=0.05) for i in range(2)]
    servers = [ServerThread(s).start() for s in stubs]
    pre, dec = [servers[0].url], [s.url for s in servers[1:]]
    reps = []
    for i in range(2):
        cfg = ProxyConfig(prefill=pre, decode=dec, policy="jsq", state=url, admin_token=TOKEN, health_interval_s=0,
                          state_reserve_ms=1000.0, decision_log=str(tmp_path / f"dec{i}.jsonl")).validate()
        app = create_app(cfg)
        reps.append((app, ServerThread(app).start()))
    r = redis_py.Redis.from_url(url)
    (a, _), (b, _) = reps
    assert _until(lambda: a.state.shared.live_replicas == 2 and b.state.shared.live_replicas == 2)
    yield reps, stubs[1:], dec, r, a.state.shared.ns
    for _, s in reps:
        s.stop()
    for s in servers:
        s.stop()
    r.close()




def _stream(url, i, out, n=1, max_tokens=20):
    for j in range(n):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "m", "prompt": f"r{i}-{j}", "max_tokens": max_tokens, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
            out.append(r.status_code)


def _run(url, streams, per_stream, decoders, sample=None):
    out: list = []
    before = [d.stats["decode"] for d in decoders]
    ts = [threading.Thread(target=_stream, args=(url, i, out, per_stream)) for i in range(streams)]
    for t in ts:
        t.start()
    spreads = []
    while any(t.is_alive() for t in ts):
        spreads.append(abs(decoders[0].running - decoders[1].running))
        time.sleep(0.02)
    for t in ts:
        t.join()
    assert out == [200] * (streams * per_stream)
    return [d.stats["decode"] - b for d, b in zip(decoders, before, strict=True)], max(spreads, default=0)


@contextlib.contextmanager
def _forging(r, key, field, value):
    """An attacker rewriting ``field`` of hash ``key`` every 5 ms while the block runs (the replica's own
    reservations and releases rewrite it too: the attacker keeps at it)."""
    stop = threading.Event()

    def keep_writing():
        while not stop.is_set():
            r.hset(key, field, value)
            time.sleep(0.005)

    t = threading.Thread(target=keep_writing)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _decisions(app, path):
    """Every row of ``app``'s decision log: (the loads it decided on, the position of the worker used)."""
    app.decision_log.flush()
    return [(row["loads"], row["chosen"]) for row in map(orjson.loads, path.read_bytes().splitlines())]


# How far over the least load an honest JSQ decision may land: Redis's slots lag the loads the decision saw by
# this replica's operations still on their way (a release of a finished request, sent after its local count
# dropped, and another stream's reservation not yet landed: the cap on the replica's own field is its held slots
# plus every pending reservation). One of each: CI once saw loads [2, 0] go to the first, with no reservation
# late, when the bound was one. A forged value that is not ignored fails the share test before this one.
ON_THE_WAY = 2


def _over(rows, bound):
    """The decisions whose worker's load was more than ``bound`` over the least load when decided."""
    return [(loads, c) for loads, c in rows if loads[c] > min(loads) + bound]


def test_the_issues_forged_slots_under_a_bare_key_are_ignored(cluster, tmp_path):
    reps, decoders, dec, r, ns = cluster
    (a, sa), _ = reps
    r.hset(f"{ns}:reserved", f"zz|decode|{dec[0]}", 1_000_000)
    r.set(f"{ns}:inflight:zz", "x")  # a bare key: no signed heartbeat
    per, spread = _run(sa.url, 4, 10, decoders)
    assert min(per) >= 10, per  # the issue: 40 of 40 went to d1
    rows = _decisions(a, tmp_path / "dec0.jsonl")
    print(f"bare-key forgery, 4 streams x 10: per decoder {per}, largest spread at the decoders {spread}")
    # JSQ on the loads it saw, give or take ON_THE_WAY (steered, d1 would run 3 ahead); a late reservation decides
    # locally on the loads of that later moment instead, so those are allowed (counted)
    late = a.state.shared.reserver.results["timeout"]
    assert len(rows) == 40 and len(_over(rows, ON_THE_WAY)) <= late, (rows, late)
    # the bare key does not keep the forged field alive: the next cleanup (about 1/s) removes it
    assert _until(lambda: r.hget(f"{ns}:reserved", f"zz|decode|{dec[0]}") is None, 3)


@pytest.mark.parametrize("value", ["nan", "-inf", "inf", "-5", "1.5", str(MAX_IN_FLIGHT + 1), "x"])
def test_values_outside_the_range_are_ignored_and_counted(cluster, value, tmp_path):
    reps, decoders, dec, r, ns = cluster
    (a, sa), (b, _) = reps
    field = f"{b.state.shared.replica_id}|decode|{dec[0]}"  # under a live replica's name
    with _forging(r, f"{ns}:reserved", field, value):
        per, spread = _run(sa.url, 4, 6, decoders)
    assert min(per) >= 6, (per, spread)  # of 24
    rows = _decisions(a, tmp_path / "dec0.jsonl")
    late = a.state.shared.reserver.results["timeout"]  # as above: a late answer decides on later loads
    assert len(rows) == 24 and len(_over(rows, ON_THE_WAY)) <= late, (rows, late)
    assert a.state.shared.rejected["reservation_range"] > 0


def test_the_forged_share_is_bounded_by_the_slack(cluster, tmp_path):
    """In-range forged slots under a live replica's name (the worst an attacker without the key can do):
    d0 looks full in Redis, so decisions move to d1, but only among the workers whose signed load was within
    SLACK of the least when the decision was made: checked on every decision in A's log (the loads it decided
    on, the worker used). The decoders' running counts are printed, not asserted: they lag the proxy's counts
    by the requests in transit, which depends on the machine's speed (CI once saw 6 there)."""
    reps, decoders, dec, r, ns = cluster
    (a, sa), (b, _) = reps
    field = f"{b.state.shared.replica_id}|decode|{dec[0]}"
    with _forging(r, f"{ns}:reserved", field, MAX_IN_FLIGHT):
        per, spread = _run(sa.url, 16, 3, decoders)
    rows = _decisions(a, tmp_path / "dec0.jsonl")
    over = _over(rows, SLACK)
    moved = sum(c == 1 and loads[1] > loads[0] for loads, c in rows)
    print(f"forged in-range slots under a live replica's name, 16 streams x 3: per decoder {per}, decisions moved "
          f"off the least loaded {moved}, largest spread at the decoders {spread}")
    assert len(rows) == 48
    assert moved > 0  # the forged slots do steer (else this test would show nothing) ...
    late = a.state.shared.reserver.results["timeout"]  # a late answer: the least loaded of that moment instead
    assert len(over) <= late, (over, late)  # ... but never beyond SLACK over the least signed load
    assert min(per) >= 48 * 0.25, per  # d0 still takes its share once d1 is SLACK ahead
