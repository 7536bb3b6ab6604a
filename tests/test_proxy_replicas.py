"""Several proxy replicas sharing decode load through a real Redis server (never a mock).

Stub PD workers with slow streams keep requests in flight; the replicas are in-process apps (and, for
failover and --workers, real `eldr serve-proxy` processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.proxy.replicas.shared import STALENESS_BOUND_S
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import ServerThread, wait_http
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "nSdsgYHMUJrNra6uG3HvVlMwp2n0I0q0tjf_TZkhnjY"  # strong enough to derive the state key
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as r:
        yield r


_db = iter(range(1, 16))


@pytest.fixture
def redis_url(redis):
    return f"redis://{redis.host}:{redis.port}/{next(_db)}"  # a database (and channel names) per test


@pytest.fixture
def workers():
    stubs = [StubWorker(f"p{i}", token_delay_s=0.05) for i in range(2)] + \
            [StubWorker(f"d{i}", token_delay_s=0.05) for i in range(2)]
    servers = [ServerThread(s).start() for s in stubs]
    yield [s.url for s in servers[:2]], [s.url for s in servers[2:]]
    for s in servers:
        s.stop()


def _replica(pre, dec, state, **kw):
    cfg = ProxyConfig(prefill=pre, decode=dec, policy="jsq", state=state, admin_token=TOKEN,
                      health_interval_s=0, **kw).validate()
    app = create_app(cfg)
    return app, ServerThread(app).start()


def _stream(url, n_tokens, results, prompt="hello"):
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"model": "m", "prompt": prompt, "max_tokens": n_tokens, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
            results.append(r.status_code)
    except httpx.HTTPError as e:
        results.append(repr(e))


def _until(cond, timeout, step=0.05):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def _cluster_decode(app) -> list[int]:
    return [w.inflight + w.remote_inflight for w in app.state.decode]


def test_replicas_see_each_others_inflight_and_decide_on_it(workers, redis_url):
    pre, dec = workers
    (a, sa), (b, sb) = _replica(pre, dec, redis_url), _replica(pre, dec, redis_url)
    try:
        assert _until(lambda: b.state.shared.live_replicas == 2 and a.state.shared.live_replicas == 2, 5)
        res: list = []
        t = threading.Thread(target=_stream, args=(sa.url, 60, res))  # ~3 s on decoder d0 (JSQ tie -> first)
        t.start()
        assert _until(lambda: _cluster_decode(b) == [1, 0], 3), _cluster_decode(b)
        h = httpx.get(sb.url + "/health").json()
        assert h["replicas"] == 2 and h["state"] == "redis"
        d0 = next(w for w in h["workers"] if w["url"] == dec[0])
        assert d0["inflight"] == 0 and d0["cluster_inflight"] == 1  # B's own count, and everybody's
        # B's JSQ decision sees A's request: its own counts are [0, 0] but it must pick d1
        r = httpx.post(sb.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        d1 = b.state.decode.find(dec[1])
        assert d1 is not None and b.metrics.child(b.metrics.decisions, "jsq", d1.id)._value.get() == 1
        t.join()
        assert res == [200]
        assert _until(lambda: _cluster_decode(b) == [0, 0], 3)
        assert "eldr_proxy_state_sync_age_seconds" in httpx.get(sb.url + "/metrics").text
    finally:
        sa.stop()
        sb.stop()


def test_admin_changes_reach_every_replica_and_refusals_reach_none(workers, redis_url):
    pre, dec = workers
    (a, sa), (b, sb) = _replica(pre, dec, redis_url), _replica(pre, dec, redis_url)
    try:
        assert _until(lambda: b.state.shared.live_replicas == 2, 5)
        r = httpx.post(sa.url + "/admin/policy", json={"policy": "round-robin"}, headers=AUTH)
        assert r.status_code == 200
        assert _until(lambda: b.state.policy_name == "round-robin", 3)
        # refused on A (unknown policy): published nowhere
        r = httpx.post(sa.url + "/admin/policy", json={"policy": "nonsense"}, headers=AUTH)
        assert r.status_code == 400
        time.sleep(3 * 0.25)
        assert a.state.policy_name == b.state.policy_name == "round-robin"
        # a worker removed on B disappears on A; added back on A reappears on B
        r = httpx.post(sb.url + "/admin/workers", json={"action": "remove", "role": "decode", "url": dec[1]},
                       headers=AUTH)
        assert r.status_code == 200
        assert _until(lambda: [w.url for w in a.state.decode] == [dec[0]], 3)
        r = httpx.post(sa.url + "/admin/workers", json={"action": "add", "role": "decode", "url": dec[1]},
                       headers=AUTH)
        assert r.status_code == 200
        assert _until(lambda: [w.url for w in b.state.decode] == dec, 3)
    finally:
        sa.stop()
        sb.stop()


def _serve_proxy(pre, dec, state, port, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), ELDR_ADMIN_TOKEN=TOKEN)  # the signing key
    return subprocess.Popen([sys.executable, "-m", "eldr_cli", "serve-proxy", "--policy", "jsq",
                             "--state", state, "--port", str(port), *sum((["--prefill", u] for u in pre), []),
                             *sum((["--decode", u] for u in dec), []), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_a_killed_replica_stops_counting_within_the_bound(workers, redis_url):
    pre, dec = workers
    port = free_port()
    victim = _serve_proxy(pre, dec, redis_url, port)
    a, sa = _replica(pre, dec, redis_url)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proc=victim)
        res: list = []
        ts = [threading.Thread(target=_stream, args=(f"http://127.0.0.1:{port}", 200, res, f"p{i}"))
              for i in range(3)]
        for t in ts:
            t.start()
        assert _until(lambda: sum(_cluster_decode(a)) == 3, 5), _cluster_decode(a)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        gone = _until(lambda: sum(_cluster_decode(a)) == 0, 5, step=0.02)
        assert gone is not None and gone <= STALENESS_BOUND_S + 0.3, gone
        assert _until(lambda: a.state.shared.live_replicas == 1, 2)
        for t in ts:
            t.join()
    finally:
        if victim.poll() is None:
            victim.kill()
        sa.stop()


def test_redis_down_means_local_routing_and_no_failed_request(workers):
    pre, dec = workers
    with RedisServer() as r:
        (a, sa), (_, sb) = _replica(pre, dec, r.url), _replica(pre, dec, r.url)
        try:
            assert _until(lambda: a.state.shared.live_replicas == 2, 5)
            r.kill()
            codes = []
            for i in range(20):  # during the outage
                resp = httpx.post(sa.url + "/v1/completions", json={"model": "m", "prompt": f"q{i}", "max_tokens": 2},
                                  timeout=30)
                codes.append(resp.status_code)
            assert codes == [200] * 20
            assert _until(lambda: a.state.shared.in_outage, 3)
            assert a.state.shared.outages == 1 and a.state.shared.live_replicas == 1
            assert a.state.shared.outage_kind == "unreachable"
            assert all(w.remote_inflight == 0 for w in a.state.decode)
            r.start()  # same port: sharing resumes by itself
            assert _until(lambda: a.state.shared.live_replicas == 2 and not a.state.shared.in_outage, 10)
            assert a.state.shared.outages == 1
        finally:
            sa.stop()
            sb.stop()


def test_workers_two_processes_behind_one_port(workers):
    pre, dec = workers
    port = free_port()
    p = _serve_proxy(pre, dec, "local", port, "--workers", "2")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 90, proc=p)
        assert _until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").json().get("replicas") == 2, 20)
        codes = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": f"w{i}", "max_tokens": 2}).status_code for i in range(30)]
        assert codes == [200] * 30
        seen = {httpx.get(f"http://127.0.0.1:{port}/health").json()["replica"] for _ in range(40)}
        assert len(seen) == 2  # the kernel spreads connections over both processes
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    assert p.returncode in (0, 130)
