"""The two trust gaps of issue 36 (item 8), through a real redis-server (requirepass on) and real in-process
replicas in front of stub workers. The attacker has the Redis password but neither the state key nor the
admin token.

1. A heartbeat captured off Redis and replayed after its replica stopped must not bring the replica back:
   a replica is alive while its signed sequence grows on the receiver's clock (a replay never grows it), and a
   clean stop seals a goodbye that ends its origin. With the goodbye suppressed, a stopped replica counts at
   most the staleness bound after its last news, as a crashed one does; the replays change nothing.
2. An admin token weaker than a state key (``letmein``) is refused at start, even beside a strong state key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import redis as redis_py
from _proxy_util import until as _until

from eldr_cli.errors import EldrError
from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.auth import COUNTS_WINDOW_S
from eldr_cli.proxy.replicas.peers import Peers
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

PASSWORD = "redis-pass-36"
KEY = "Hq1w7tX0aVd3s_NbEu5kLm8Rz2pYc-JoG4fI9rTeW6U"  # the state key: 43 base64url characters
TOKEN = "pP3uG-8vQk2Zr6XyT1bW0nLh5sJd9aFcE4mKo7iRqYw"  # a strong admin token, distinct from the key


@pytest.fixture(scope="module")
def redis():
    with RedisServer(password=PASSWORD) as r:
        yield r


_db = iter(range(1, 16))


@pytest.fixture
def lab(redis, monkeypatch):
    """Stub workers, replica A (the observer), replica B (the one that stops) and the attacker's client."""
    monkeypatch.setenv("ELDR_STATE_KEY", KEY)
    url = f"redis://:{PASSWORD}@{redis.host}:{redis.port}/{next(_db)}"
    stubs = [ServerThread(StubWorker(n)).start() for n in ("p0", "d0", "d1")]
    pre, dec = [stubs[0].url], [s.url for s in stubs[1:]]
    (a, sa), (b, sb) = (_replica(pre, dec, url) for _ in range(2))
    r = redis_py.Redis.from_url(url)
    assert _until(lambda: a.state.shared.live_replicas == 2)
    yield (a, sa), (b, sb), r
    for s in (sa, sb, *stubs):
        s.stop()
    r.close()


def _replica(pre, dec, state):
    cfg = ProxyConfig(prefill=pre, decode=dec, policy="jsq", state=state, admin_token=TOKEN,
                      health_interval_s=0).validate()
    app = create_app(cfg)
    return app, ServerThread(app).start()




def _load(b, sb, n):
    """B's decoders hold ``n`` requests each, as its in-flight streams would (the issue's 3 per decoder)."""
    async def put():
        for w in b.state.decode:
            w.inflight = n
        b.state.shared.note_change()

    sb.call(put())


def _seen(a) -> list[int]:
    """What A adds to its own counts for the other replicas, per decoder."""
    return [w.remote_inflight for w in a.state.decode]


def _capture(a, b, sb, r, n=3):
    """B loaded with ``n`` per decoder, A seeing it; B's heartbeat as the attacker reads it off Redis:
    (the signed bytes, their seal time in s, B's heartbeat key, the registry)."""
    ns, bid = b.state.shared.ns, b.state.shared.replica_id
    _load(b, sb, n)
    assert _until(lambda: _seen(a) == [n, n])
    key = f"{ns}:inflight:{bid}"
    got: list[bytes] = []

    def loaded() -> bool:  # the next heartbeat B writes carries the loads (the message that A saw came first)
        got[:] = [r.get(key)]
        c = orjson.loads(got[0].partition(b".")[2])["p"]["c"]
        return {v for k, v in c.items() if k.startswith("decode|")} == {n}

    assert _until(loaded, 3)
    body = orjson.loads(got[0].partition(b".")[2])
    assert body["o"] == bid  # a genuine heartbeat of B's, carrying the loads
    return got[0], body["t"] / 1000, key, f"{ns}:replicas"


def _replay(r, beat, key, registry, bid, counts_channel, until_s, a):
    """Replay the captured heartbeat (its key rewritten, the registry re-filled, the message republished) every
    20 ms until ``until_s`` (wall clock); returns A's view sampled meanwhile: [(monotonic time, phantom?)]."""
    samples = []
    while time.time() < until_s:
        pipe = r.pipeline(transaction=False)
        pipe.set(key, beat, px=5000).sadd(registry, bid).publish(counts_channel, beat)
        pipe.execute()
        samples.append((time.monotonic(), a.state.shared.live_replicas > 1 or any(_seen(a))))
        time.sleep(0.02)
    return samples


def test_a_replayed_heartbeat_does_not_revive_a_replica_that_said_goodbye(lab):
    (a, sa), (b, sb), r = lab
    beat, sealed_s, key, registry = _capture(a, b, sb, r)
    _load(b, sb, 0)  # B's requests end: its newer counts say 0
    assert _until(lambda: _seen(a) == [0, 0])
    bid, channel = b.state.shared.replica_id, f"{b.state.shared.ns}:counts"
    sb.stop()  # a clean stop: B's signed goodbye
    assert _until(lambda: a.state.shared.live_replicas == 1, 3)
    until = sealed_s + COUNTS_WINDOW_S - 1.0  # the replayed message stays inside its time window throughout
    samples = _replay(r, beat, key, registry, bid, channel, until, a)
    assert len(samples) > 10 and not any(p for _, p in samples), "a replayed heartbeat revived the stopped replica"
    assert time.time() - sealed_s < COUNTS_WINDOW_S  # positive control: its time stamp alone would pass
    assert a.state.shared.rejected["ended"] > 0  # refused as a message of a replica that said goodbye
    h = httpx.get(sa.url + "/health").json()
    assert h["replicas"] == 1 and h["state_rejected"]["ended"] > 0


def test_with_the_goodbye_suppressed_a_replay_does_not_extend_a_stopped_replica(lab):
    (a, sa), (b, sb), r = lab
    beat, sealed_s, key, registry = _capture(a, b, sb, r)
    time.sleep(0.3)  # B heartbeats on (A sees newer sequences), loads unchanged: then it stops, loaded

    async def suppressed(*args):  # the attacker drops B's goodbye (e.g. on a path without TLS)
        return None

    bid, channel = b.state.shared.replica_id, f"{b.state.shared.ns}:counts"
    b.state.shared._say_goodbye = suppressed
    t_stop = time.monotonic()
    sb.stop()
    until = sealed_s + COUNTS_WINDOW_S - 0.5
    samples = _replay(r, beat, key, registry, bid, channel, until, a)
    assert time.time() - sealed_s < COUNTS_WINDOW_S  # the replays were inside their time window to the end
    gone = [t for t, p in samples if not p]
    assert gone, "the stopped replica counted until its heartbeat's time window ended"
    assert not any(p for t, p in samples if t > gone[0]), "a replay brought the stopped replica back"
    print(f"\ngoodbye suppressed: the stopped replica counted {gone[0] - t_stop:.2f} s after its stop "
          f"(bound {b.state.shared.peers.bound_s} s after its last news); replays went on "
          f"{samples[-1][0] - gone[0]:.2f} s more without effect")


def test_liveness_is_growth_on_the_receivers_clock():
    now = [0.0]
    p = Peers(1.3, clock=lambda: now[0], memory_s=60.0)
    assert p.grew("b", 5) and p.alive("b")
    now[0] = 1.0
    assert not p.grew("b", 5) and not p.grew("b", 4)  # a replayed or older message is no news ...
    now[0] = 1.31
    assert not p.alive("b")  # ... so it keeps nothing alive past the bound
    assert p.grew("b", 6) and p.alive("b")  # a newer one does
    p.end("b")
    assert not p.alive("b") and not p.grew("b", 99) and p.ended("b")  # after a goodbye: nothing, ever
    now[0] = 62.0
    p.forget_old()
    assert not p.ended("b")  # forgotten once every message of it is stale


def _run(args, env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="200")
    for k in ("ELDR_STATE_KEY", "ELDR_ADMIN_TOKEN", "ELDR_STATE_PASSWORD"):
        e.pop(k, None)
    e.update(env)
    return subprocess.run([sys.executable, "-m", "eldr_cli", "serve-proxy", "--policy", "jsq", "--prefill",
                           "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", *args], capture_output=True,
                          text=True, env=e, timeout=60)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("where", ["env", "file", "no state"])
def test_a_weak_admin_token_is_refused_at_start_even_beside_a_strong_state_key(redis, tmp_path, where):
    port = free_port()
    url = f"redis://{redis.host}:{redis.port}/0"
    args, env = ["--port", str(port)], {"ELDR_STATE_KEY": KEY, "ELDR_STATE_PASSWORD": PASSWORD}
    if where != "no state":
        args += ["--state", url]
    if where == "file":
        tok = tmp_path / "admin.token"
        tok.write_text("letmein\n")
        tok.chmod(0o600)
        args += ["--admin-token-file", str(tok)]
    else:
        env["ELDR_ADMIN_TOKEN"] = "letmein"
    r = _run(args, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "serve-proxy on" not in r.stdout
    errors = [ln for ln in r.stderr.splitlines() if ln.lower().startswith("error")]
    assert len(errors) == 1 and "admin token" in errors[0] and "too weak" in errors[0], r.stderr
    assert ("--admin-token-file" if where == "file" else "ELDR_ADMIN_TOKEN") in errors[0]
    assert "token_urlsafe(32)" in r.stderr and "letmein" not in r.stderr  # how to make one; the token never shown
    assert not _listening(port)  # nothing bound


def test_a_strong_token_beside_a_strong_key_opens_the_admin_api_and_a_guess_does_not(redis, monkeypatch):
    monkeypatch.setenv("ELDR_STATE_KEY", KEY)
    with pytest.raises(EldrError, match="admin token .* too weak"):
        ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"], policy="jsq",
                    state=f"redis://:{PASSWORD}@{redis.host}:{redis.port}/0", admin_token="letmein").validate()
    stub = ServerThread(StubWorker("w")).start()
    app, srv = _replica([stub.url], [stub.url], f"redis://:{PASSWORD}@{redis.host}:{redis.port}/{next(_db)}")
    try:
        ok = httpx.get(srv.url + "/admin/workers", headers={"authorization": f"Bearer {TOKEN}"})
        guess = httpx.get(srv.url + "/admin/workers", headers={"authorization": "Bearer letmein"})
        assert ok.status_code == 200 and guess.status_code == 401
    finally:
        srv.stop()
        stub.stop()
