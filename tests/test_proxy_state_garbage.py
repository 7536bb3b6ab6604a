"""Garbage in one key is one bad key, not an outage (issue 28, item 4): the writes of the issue, made with
a plain Redis client (password, no key) against two real replicas over a real redis-server; sharing goes
on with the good replica, each bad entry is counted by reason, and the outage path is kept for Redis being
unreachable or refusing (and says which)."""

from __future__ import annotations

import resource
import time

import httpx
import pytest
import redis as redis_py
from _proxy_util import until as _until

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "h8qAN_4KJ3LkA2nwK-gAoS0kWk-PmtQkgX_LJuAtJ-E"  # a test token: 43 base64url characters
PASSWORD = "redis-pass-4"


@pytest.fixture(scope="module")
def redis():
    with RedisServer(password=PASSWORD) as r:
        yield r


_db = iter(range(1, 16))


@pytest.fixture
def pair(redis):
    """Replicas A and B over d0, d1 (reservation on); the attacker's client; the namespace."""
    servers = [ServerThread(StubWorker(n)).start() for n in ("p0", "d0", "d1")]
    p0, d0, d1 = (s.url for s in servers)
    db = next(_db)
    url = f"redis://:{PASSWORD}@{redis.host}:{redis.port}/{db}"
    apps = []
    for _ in range(2):
        cfg = ProxyConfig(prefill=[p0], decode=[d0, d1], policy="jsq", state=url, admin_token=TOKEN,
                          health_interval_s=0).validate()
        app = create_app(cfg)
        apps.append((app, ServerThread(app).start()))
    r = redis_py.Redis(host=redis.host, port=redis.port, password=PASSWORD, db=db)
    yield apps, r, f"eldr:{db}"
    for _, s in apps:
        s.stop()
    for s in servers:
        s.stop()
    r.flushdb()
    r.close()




def _always(cond, duration=1.0, step=0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration:
        if not cond():
            return False
        time.sleep(step)
    return True


def _shared(app):
    return app.state.shared


def _both_live(a, b):
    """Both replicas see each other: A seeing B's first heartbeat does not mean B has finished it."""
    return _until(lambda: _shared(a).live_replicas == 2 and _shared(b).live_replicas == 2)


def _ok_requests(url, n=5):
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": f"q{i}", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


@pytest.mark.parametrize("attack", ["registry-a-string", "registry-bad-bytes", "reserved-a-string",
                                    "config-a-hash", "inflight-a-list"])
def test_one_bad_key_is_one_bad_key(pair, attack):
    ((a, sa), (b, _)), r, ns = pair
    assert _both_live(a, b)
    if attack == "registry-a-string":
        r.delete(f"{ns}:replicas")
        r.set(f"{ns}:replicas", "x")
    elif attack == "registry-bad-bytes":
        r.sadd(f"{ns}:replicas", b"\xff\xfe", b"../../x", b"")
    elif attack == "reserved-a-string":
        r.set(f"{ns}:reserved", "x")
    elif attack == "config-a-hash":
        r.delete(f"{ns}:config")
        r.hset(f"{ns}:config", "a", "b")
    else:
        r.rpush(f"{ns}:inflight:zz", "x")
        r.sadd(f"{ns}:replicas", "zz")
    # sharing never stops: both replicas see each other at every look for a second, no outage
    assert _always(lambda: _shared(a).live_replicas == 2 and not _shared(a).in_outage
                   and _shared(b).live_replicas == 2 and not _shared(b).in_outage, 1.0)
    _ok_requests(sa.url)
    assert _shared(a).outages == _shared(b).outages == 0
    h = httpx.get(sa.url + "/health").json()
    assert h["state_outage"] is None and h["replicas"] == 2
    # counted by whichever replica met the bad entry first (it clears it)
    seen = {k: _shared(a).rejected[k] + _shared(b).rejected[k] for k in ("wrong_type", "malformed")}
    assert sum(seen.values()) > 0, seen


def test_a_flood_of_fake_replica_names_does_not_hide_the_real_one(pair):
    ((a, _), (b, _)), r, ns = pair
    assert _both_live(a, b)
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.sadd(f"{ns}:replicas", f"fake{i}")
        pipe.set(f"{ns}:inflight:fake{i}", "garbage", px=60_000)
    pipe.execute()
    assert _always(lambda: _shared(a).live_replicas == 2 and _shared(b).live_replicas == 2, 1.5)
    assert _until(lambda: r.scard(f"{ns}:replicas") == 2, 10)  # the garbage names are cleared from the registry
    assert _shared(a).rejected["unsigned"] > 0


def test_a_huge_value_is_capped_not_read(pair):
    ((a, sa), (b, _)), r, ns = pair
    assert _both_live(a, b)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    r.setrange(f"{ns}:inflight:big", (64 << 20) - 1, b"x")  # 64 MiB made by the server, not by this process
    r.sadd(f"{ns}:replicas", "big")
    assert _until(lambda: _shared(a).rejected["oversized"] + _shared(b).rejected["oversized"] > 0)
    assert _always(lambda: _shared(a).live_replicas == 2 and not _shared(a).in_outage, 0.5)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grew_mib < 32, grew_mib  # both replicas live in this process: neither read the 64 MiB
    _ok_requests(sa.url)


def test_a_huge_reservation_hash_is_dropped(pair):
    ((a, sa), (b, _)), r, ns = pair
    assert _both_live(a, b)
    pipe = r.pipeline(transaction=False)
    for i in range(0, 100_000, 1000):
        pipe.hset(f"{ns}:reserved", mapping={f"zz{j}|decode|http://x": 1 for j in range(i, i + 1000)})
    pipe.execute()
    assert _until(lambda: r.hlen(f"{ns}:reserved") < 100, 3)
    assert _shared(a).rejected["oversized"] + _shared(b).rejected["oversized"] >= 1
    ok = _shared(a).reserver.results["ok"]
    _ok_requests(sa.url)
    assert _shared(a).reserver.results["ok"] > ok and not _shared(a).in_outage  # reservations work again


def test_the_outage_says_which(pair, redis):
    ((a, sa), _), r, ns = pair
    assert _until(lambda: _shared(a).live_replicas == 2)
    r.acl_setuser("default", enabled=True, passwords=[f"+{PASSWORD}"], commands=["+@all", "-set"], keys=["*"],
                  channels=["*"])
    try:
        assert _until(lambda: _shared(a).in_outage, 5)
        h = httpx.get(sa.url + "/health").json()
        assert h["state_outage"] == "refusing" and h["replicas"] == 1
        _ok_requests(sa.url, 2)
    finally:
        r.acl_setuser("default", enabled=True, passwords=[f"+{PASSWORD}"], commands=["+@all"], keys=["*"],
                      channels=["*"])
    assert _until(lambda: not _shared(a).in_outage and _shared(a).live_replicas == 2, 5)
