"""Replays die across restarts (issue 28, item 1): a replica killed with SIGKILL and started again in the
middle of a sequence of admin changes takes the cluster's configuration from the signed snapshot within
one heartbeat, and no captured change republished afterwards moves it. Real redis-server (requirepass),
a real `eldr serve-proxy` process for the replica that is killed, stub workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis as redis_py

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import ServerThread, wait_http
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "nSdsgYHMUJrNra6uG3HvVlMwp2n0I0q0tjf_TZkhnjY"  # a test token: 43 base64url characters
AUTH = {"authorization": f"Bearer {TOKEN}"}
PASSWORD = "redis-pass-3"


@pytest.fixture(scope="module")
def redis():
    with RedisServer(password=PASSWORD) as r:
        yield r


@pytest.fixture
def stubs():
    servers = [ServerThread(StubWorker(name)).start() for name in ("p0", "d0", "d1", "d2")]
    yield [s.url for s in servers], servers[3].app
    for s in servers:
        s.stop()


def _until(cond, timeout=5.0, step=0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def _serve(pre, dec, url, port):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), ELDR_ADMIN_TOKEN=TOKEN, ELDR_STATE_PASSWORD=PASSWORD)
    return subprocess.Popen([sys.executable, "-m", "eldr_cli", "serve-proxy", "--policy", "jsq", "--state", url,
                             "--port", str(port), "--prefill", pre, *sum((["--decode", u] for u in dec), [])],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _config(base):
    c = httpx.get(base + "/admin/workers", headers=AUTH, timeout=10).json()
    return c["policy"], [w["url"] for w in c["decode"]], [w["url"] for w in c["decode"] if not w["healthy"]]


def _admin(base, action, body):
    r = httpx.post(f"{base}/admin/{action}", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def _captured(ps, n, timeout=5.0):
    out, t0 = [], time.monotonic()
    while len(out) < n and time.monotonic() - t0 < timeout:
        m = ps.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if m and m["type"] == "message":
            out.append(m["data"])
    assert len(out) == n, out
    return out


def test_a_killed_and_restarted_replica_takes_the_current_configuration_and_ignores_replays(stubs, redis):
    (p0, d0, d1, d2), d2_stub = stubs
    url = f"redis://{redis.host}:{redis.port}/3"
    cfg = ProxyConfig(prefill=[p0], decode=[d0, d1], policy="jsq", admin_token=TOKEN, health_interval_s=0,
                      state=f"redis://:{PASSWORD}@{redis.host}:{redis.port}/3").validate()
    a = create_app(cfg)
    sa = ServerThread(a).start()
    port = free_port()
    b_url = f"http://127.0.0.1:{port}"
    b = _serve(p0, [d0, d1], url, port)
    attacker = redis_py.Redis(host=redis.host, port=redis.port, password=PASSWORD, db=3)
    ps = attacker.pubsub()
    try:
        wait_http(b_url + "/health", 60, proc=b)
        assert _until(lambda: a.state.shared.live_replicas == 2)
        ps.subscribe("eldr:3:admin")
        assert ps.get_message(timeout=2)["type"] == "subscribe"
        _admin(sa.url, "workers", {"action": "add", "role": "decode", "url": d2})
        _admin(sa.url, "policy", {"policy": "round-robin"})
        early = attacker.get("eldr:3:config")  # a signed snapshot that will be outdated
        assert _until(lambda: _config(b_url) == ("round-robin", [d0, d1, d2], []))
        b.send_signal(signal.SIGKILL)
        b.wait(10)
        _admin(sa.url, "workers", {"action": "remove", "role": "decode", "url": d2})
        _admin(sa.url, "policy", {"policy": "p2c"})
        captured = _captured(ps, 4)  # add d2, round-robin, remove d2, p2c
        want = ("p2c", [d0, d1], [])
        b = _serve(p0, [d0, d1], url, port)  # its command line says jsq: the cluster says p2c
        wait_http(b_url + "/health", 60, proc=b)
        took = _until(lambda: _config(b_url) == want, 1.0)
        assert took is not None and took <= 0.5, _config(b_url)  # at most a few heartbeats after it answers
        # the attack: the captured changes, republished to the restarted replica (within 30 s)
        for m in [*captured, captured[0], captured[1]]:
            attacker.publish("eldr:3:admin", m)
        attacker.set("eldr:3:config", early)  # and the snapshot rolled back to an older signed one
        time.sleep(0.6)  # several heartbeats
        assert _config(b_url) == want and _config(sa.url) == want
        assert _until(lambda: attacker.get("eldr:3:config") != early, 1.0) is not None  # rewritten
        for i in range(30):
            r = httpx.post(b_url + "/v1/completions", json={"model": "m", "prompt": f"q{i}", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200
        assert sum(d2_stub.stats.values()) == 0  # nothing reached the removed decoder
        rej_b = httpx.get(b_url + "/health").json()["state_rejected"]
        assert rej_b["before_join"] >= 4, rej_b  # issued before B started: the snapshot, not the channel
        hb = httpx.get(b_url + "/health").json()
        assert hb["replicas"] == 2 and hb["policy"] == "p2c"
    finally:
        ps.close()
        attacker.close()
        if b.poll() is None:
            b.kill()
            b.wait(10)
        sa.stop()


def test_config_versions_order_changes_and_snapshots():
    from eldr_cli.proxy.replicas.auth import Envelope
    from eldr_cli.proxy.replicas.configsync import ConfigSync

    key, ns = b"k" * 32, "eldr:0"
    a, b = ConfigSync(Envelope(key, ns, "a"), ns), ConfigSync(Envelope(key, ns, "b"), ns)
    b.joined_ms -= 1000  # b started a second ago
    m1 = a.seal_change("policy", {"policy": "p2c"})
    assert b.open_change(m1, ("policy",)) is None and b.env.rejected["unsynced"] == 1  # before its first read
    b.synced = True
    m2 = a.seal_change("policy", {"policy": "jsq"})
    assert b.open_change(m2, ("policy",)) == ("policy", {"policy": "jsq"}) and b.version == (2, "a")
    # a replica started after a change was issued never takes it from the channel
    c = ConfigSync(Envelope(key, ns, "c"), ns)
    c.synced = True
    c.joined_ms += 10_000
    assert c.open_change(a.seal_change("policy", {}), ("policy",)) is None and c.env.rejected["before_join"] == 1
    # a change below what a live replica runs is outdated (its heartbeat names version 9)
    d = ConfigSync(Envelope(key, ns, "d"), ns)
    d.synced, d.joined_ms, d.peer_max = True, d.joined_ms - 1000, (9, "x")
    assert d.open_change(ConfigSync(Envelope(key, ns, "e"), ns).seal_change("policy", {}), ("policy",)) is None
    assert d.env.rejected["outdated"] == 1
    # snapshots: a newer one is adopted, an older one rewritten, a missing one written once there is a version
    cur = {"policy": "jsq"}
    snap_old = a.seal_snapshot({"policy": "old"})  # at a's version 3
    a.seal_change("policy", {})
    snap_new = a.seal_snapshot({"policy": "new"})  # at version 4
    fresh = ConfigSync(Envelope(key, ns, "f"), ns)
    assert fresh.on_snapshot(None, lambda: cur) == ("keep", None)
    assert fresh.on_snapshot(snap_new, lambda: cur) == ("adopt", {"policy": "new"}) and fresh.version == (4, "a")
    assert fresh.on_snapshot(snap_old, lambda: cur) == ("write", None)  # rolled back: rewritten
    assert fresh.on_snapshot(None, lambda: cur) == ("write", None)  # deleted: rewritten
    forged = Envelope(b"z" * 32, ns, "a").seal("config", {"v": [99, "a"], "c": {"policy": "evil"}})
    assert fresh.on_snapshot(forged, lambda: cur) == ("write", None) and fresh.env.rejected["bad_signature"] == 1
