"""Replicas trust only each other (issue 23): the attack of the issue and its variants through a real
redis-server (requirepass on), against real in-process proxies in front of stub workers; no mocks.

The attacker has what the issue assumed: a Redis client (here even with the password) and no key."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
import redis as redis_py
from _proxy_util import until as _until

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas import auth
from eldr_cli.proxy.replicas.auth import Envelope, origin_hash, resolve_state_key
from eldr_cli.proxy.replicas.configsync import ConfigSync
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker

TOKEN = "h8qAN_4KJ3LkA2nwK-gAoS0kWk-PmtQkgX_LJuAtJ-E"  # a test token: 43 base64url characters
PASSWORD = "redis-pass-1"


@pytest.fixture(scope="module")
def redis():
    with RedisServer(password=PASSWORD) as r:
        yield r


_db = iter(range(1, 16))


@pytest.fixture
def redis_url(redis):
    return f"redis://:{PASSWORD}@{redis.host}:{redis.port}/{next(_db)}"


@pytest.fixture
def stubs():
    servers = [ServerThread(StubWorker(name)).start() for name in ("p0", "d0", "d1", "evil")]
    yield [s.url for s in servers], servers[3].app
    for s in servers:
        s.stop()


@pytest.fixture
def target(stubs, redis_url):
    """Replica A over d0, d1; the attacker's Redis client; the namespace and the right key."""
    (p0, d0, d1, evil), evil_stub = stubs
    a, sa = _replica([p0], [d0, d1], redis_url)
    r = redis_py.Redis.from_url(redis_url)
    yield a, sa, r, a.state.shared.ns, resolve_state_key(None, TOKEN, redis_url)[0]
    sa.stop()
    r.close()


def _replica(pre, dec, state, **kw):
    kw.setdefault("admin_token", TOKEN)
    cfg = ProxyConfig(prefill=pre, decode=dec, policy="jsq", state=state, health_interval_s=0, **kw).validate()
    app = create_app(cfg)
    return app, ServerThread(app).start()




def _sealed(key: bytes, ns: str, origin: str, kind: str, payload, age_s: float = 0.0) -> bytes:
    """A message signed with ``key``, its time ``age_s`` in the past."""
    env = Envelope(key, ns, origin)
    body = orjson.dumps({"o": origin, "s": 1, "t": int((time.time() - age_s) * 1000), "k": kind, "p": payload})
    return env._tag(body) + b"." + body


def _genuine(key, ns, origin):
    """A replica's change sealing (versioned, as RedisState publishes them), for a replica that is not running."""
    return ConfigSync(Envelope(key, ns, origin), ns).seal_change


def _battery(r, seal, ns, evil, real_decoder, change=None):
    """The issue's attack (and the counts and heartbeat variants), each message made by ``seal`` (changes by
    ``change``, default ``seal``)."""
    change = change or seal
    r.publish(f"{ns}:admin", change("workers", {"action": "add", "role": "decode", "url": evil}))
    r.publish(f"{ns}:admin", change("health", {"role": "decode", "url": real_decoder, "healthy": False}))
    r.publish(f"{ns}:admin", change("policy", {"policy": "round-robin"}))
    r.set(f"{ns}:inflight:ghost", seal("counts", {"c": {f"decode|{real_decoder}": 50}}), px=5000)
    r.sadd(f"{ns}:replicas", "ghost")
    r.publish(f"{ns}:counts", seal("counts", {"c": {f"decode|{real_decoder}": 50}}))


def _set_hash(origins):
    """What /health shows for a set of claimed origins (each hashed, then the sorted set hashed)."""
    import hashlib

    return hashlib.sha256(",".join(sorted(origin_hash(o) for o in origins)).encode()).hexdigest()[:12]


def _view(url):
    h = httpx.get(url + "/health").json()
    return h, {w["url"]: w for w in h["workers"] if w["role"] == "decode"}


def test_unsigned_forged_stale_and_replayed_messages_change_nothing(stubs, target):
    (p0, d0, d1, evil), evil_stub = stubs
    a, sa, r, ns, key = target
    assert _until(lambda: a.state.shared.sync_age_s() < 0.5)
    # the messages verbatim (unsigned), then signed with another key, then signed but old
    r.publish(f"{ns}:admin", orjson.dumps({"origin": "attacker", "action": "workers", "body": {
        "action": "add", "role": "decode", "url": evil}}))
    _battery(r, lambda k, p: orjson.dumps({"origin": "attacker", "action": k, "body": p}), ns, evil, d0)
    _battery(r, lambda k, p: _sealed(b"not the key" * 3, ns, "attacker", k, p), ns, evil, d0)
    _battery(r, lambda k, p: _sealed(key, ns, "attacker", k, p, age_s=120), ns, evil, d0)
    # a genuine change, then the same bytes again (replayed) after a newer one
    genuine = _genuine(key, ns, "replica-b")
    m1 = genuine("policy", {"policy": "round-robin"})
    r.publish(f"{ns}:admin", m1)
    assert _until(lambda: a.state.policy_name == "round-robin", 3)
    r.publish(f"{ns}:admin", genuine("policy", {"policy": "jsq"}))
    assert _until(lambda: a.state.policy_name == "jsq", 3)
    r.publish(f"{ns}:admin", m1)
    time.sleep(0.5)  # several heartbeats
    h, dec = _view(sa.url)
    assert set(dec) == {d0, d1} and all(w["healthy"] for w in dec.values())
    assert all(w["cluster_inflight"] == 0 for w in dec.values()) and h["replicas"] == 1
    assert h["policy"] == "jsq"
    for i in range(4):
        resp = httpx.post(sa.url + "/v1/completions", json={"model": "m", "prompt": f"q{i}", "max_tokens": 2},
                          timeout=30)
        assert resp.status_code == 200
    assert sum(evil_stub.stats.values()) == 0  # no prompt reached the attacker's server
    rej = h["state_rejected"]
    assert rej["unsigned"] >= 5 and rej["bad_signature"] >= 4 and rej["stale"] >= 4 and rej["replayed"] == 1
    wk = h["state_wrong_key"]
    assert wk["origins"] == 1 and wk["hash"] == _set_hash(["attacker"]) and "attacker" not in str(h)
    metrics = httpx.get(sa.url + "/metrics").text
    assert 'eldr_proxy_state_rejected_total{reason="bad_signature"}' in metrics


def test_the_same_battery_signed_with_the_key_takes_effect(stubs, target):
    (p0, d0, d1, evil), _ = stubs
    a, sa, r, ns, key = target
    ghost = Envelope(key, ns, "ghost")
    _battery(r, ghost.seal, ns, evil, d0, change=_genuine(key, ns, "ghost"))

    def beating():  # a live replica rewrites its heartbeat; one signed value read again is no news (issue 36)
        r.set(f"{ns}:inflight:ghost", ghost.seal("counts", {"c": {f"decode|{d0}": 50}}), px=5000)
        return len(a.state.decode) == 3 and a.state.policy_name == "round-robin" and a.state.shared.live_replicas == 2

    assert _until(beating)
    h, dec = _view(sa.url)
    assert evil in dec and not dec[d0]["healthy"]
    assert dec[d0]["cluster_inflight"] == 50 and h["replicas"] == 2  # the signed heartbeat counts
    assert sum(h["state_rejected"].values()) == 0


def test_a_remote_change_meets_the_checks_of_a_local_one(stubs, target):
    (p0, d0, d1, _), _ = stubs
    a, sa, r, ns, key = target
    signed = _genuine(key, ns, "replica-b")
    # the admin endpoint refuses these; signed remote copies are refused the same way
    local = httpx.post(sa.url + "/admin/workers", json={"action": "add", "role": "decode",
                                                        "url": "http://127.0.0.1:0"},
                       headers={"authorization": f"Bearer {TOKEN}"})
    assert local.status_code == 400
    for kind, body in (("workers", {"action": "add", "role": "decode", "url": "http://127.0.0.1:0"}),
                       ("workers", {"action": "add", "role": "decode", "url": "file:///etc/passwd"}),
                       ("health", {"role": "decode", "url": d0, "healthy": "no"}),
                       ("policy", {"policy": "nonsense"}),
                       ("reload", {"routing": "/nonexistent"})):
        r.publish(f"{ns}:admin", signed(kind, body))
    m = a.metrics
    assert _until(lambda: sum(m.child(m.admin_actions, k, "remote_refused")._value.get()
                              for k in ("workers", "health", "policy", "reload")) == 5)
    assert [w.url for w in a.state.decode] == [d0, d1] and all(w.healthy for w in a.state.decode)
    assert a.state.policy_name == "jsq"


def test_a_replica_with_the_wrong_key_is_ignored_and_visible(stubs, redis_url, tmp_path):
    (p0, d0, d1, _), _ = stubs
    keyfile = tmp_path / "other.key"
    keyfile.write_text("9mzM9C6EL3-jKnsHbIUwrOSRbB3QOuzlNETndu7vsoE")  # another strong key
    keyfile.chmod(0o600)
    a, sa = _replica([p0], [d0, d1], redis_url)
    c, sc = _replica([p0], [d0, d1], redis_url, state_key_file=str(keyfile))
    try:
        c_id, a_id = c.state.shared.replica_id, a.state.shared.replica_id
        assert _until(lambda: httpx.get(sa.url + "/health").json()["state_wrong_key"]["hash"] == _set_hash([c_id]))
        h = httpx.get(sa.url + "/health").json()
        assert h["replicas"] == 1 and h["state_rejected"]["bad_signature"] > 0
        hc = httpx.get(sc.url + "/health").json()
        assert hc["state_wrong_key"]["hash"] == _set_hash([a_id])
        assert hc["state_wrong_key"]["this_key_id"] != h["state_wrong_key"]["this_key_id"]  # told apart at a look
    finally:
        sa.stop()
        sc.stop()


def test_vectors_of_two_replicas_sum_to_what_one_proxy_holds(stubs, redis_url):
    (p0, d0, d1, _), _ = stubs
    (a, sa), (b, sb), (c, sc) = (_replica([p0], [d0, d1], redis_url) for _ in range(3))
    try:
        assert _until(lambda: c.state.shared.live_replicas == 3)
        va = {"d0": [1, 2, 3], "d1": [0, 1]}
        vb = {"d0": [4, 5, 6], "d1": [7]}

        async def put(app, vecs):
            app.state.shared.set_local_vectors("live", vecs)

        sa.call(put(a, va))
        sb.call(put(b, vb))
        one_proxy = {"d0": [5, 7, 9], "d1": [7, 1]}  # what a single proxy would hold for both
        w0, w1 = c.state.decode.find(d0), c.state.decode.find(d1)
        assert _until(lambda: w0.remote_vectors.get("live") == one_proxy["d0"]
                      and w1.remote_vectors.get("live") == one_proxy["d1"], 3), (w0.remote_vectors, w1.remote_vectors)
        wa = a.state.decode.find(d0)  # the others' sum, not its own (b's message reaches a in its own time)
        assert _until(lambda: wa.remote_vectors.get("live") == vb["d0"], 3), wa.remote_vectors
        sb.stop()  # a replica that leaves takes its vectors with it
        assert _until(lambda: w0.remote_vectors.get("live") == va["d0"], 3)
    finally:
        for s in (sa, sb, sc):
            s.stop()


def test_two_deployments_share_one_redis_through_prefixes(stubs, redis_url):
    (p0, d0, d1, _), _ = stubs
    x1, sx1 = _replica([p0], [d0, d1], redis_url, state_prefix="blue")
    x2, sx2 = _replica([p0], [d0, d1], redis_url, state_prefix="blue")
    y, sy = _replica([p0], [d0, d1], redis_url, state_prefix="green")
    y2, sy2 = _replica([p0], [d0, d1], redis_url, state_prefix="green")
    try:
        assert _until(lambda: x1.state.shared.live_replicas == 2 and y.state.shared.live_replicas == 2)
        r = httpx.post(sy.url + "/admin/policy", json={"policy": "round-robin"},
                       headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        # positive control: green's change was published and reached green's other replica ...
        assert _until(lambda: y2.state.policy_name == "round-robin", 3)
        time.sleep(0.5)
        # ... and not blue's (which counts two replicas, not four)
        assert x1.state.shared.live_replicas == 2 and x1.state.policy_name == x2.state.policy_name == "jsq"
        assert sum(x1.state.shared.rejected.values()) == 0  # nothing of green's even reached blue
    finally:
        for s in (sx1, sx2, sy, sy2):
            s.stop()


def test_redis_rejecting_the_password_later_is_an_outage_not_a_crash(stubs):
    (p0, d0, d1, _), _ = stubs
    with RedisServer(password=PASSWORD) as srv:
        url = f"redis://:{PASSWORD}@{srv.host}:{srv.port}/0"
        (a, sa), (_, sb) = _replica([p0], [d0, d1], url), _replica([p0], [d0, d1], url)
        admin = redis_py.Redis.from_url(url)
        try:
            assert _until(lambda: a.state.shared.live_replicas == 2)
            admin.config_set("requirepass", "rotated")
            admin.client_kill_filter(_type="normal", skipme=True)  # the replicas must log in again
            assert _until(lambda: a.state.shared.in_outage, 5)
            resp = httpx.post(sa.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                              timeout=30)
            assert resp.status_code == 200 and a.state.shared.outages == 1
            # first the dropped connection ("unreachable"), then the refused password: the outage says so
            assert _until(lambda: a.state.shared.outage_kind == "refusing", 3)
            h = httpx.get(sa.url + "/health").json()
            assert h["replicas"] == 1 and h["state_outage"] == "refusing"
        finally:
            sa.stop()
            sb.stop()
            admin.close()


def test_envelope_binds_bytes_namespace_and_sequence():
    key = b"k" * 32
    a, b = Envelope(key, "eldr:0", "a"), Envelope(key, "eldr:0", "b")
    msg = a.seal("policy", {"policy": "jsq"})
    assert b.open(msg, ("policy",), change=True).payload == {"policy": "jsq"}
    assert b.open(msg, ("policy",), change=True) is None and b.rejected["replayed"] == 1
    tampered = msg.replace(b'"jsq"', b'"rr!"')
    assert b.open(tampered, ("policy",)) is None and b.rejected["bad_signature"] == 1
    other_ns = Envelope(key, "blue:0", "c")
    assert other_ns.open(a.seal("policy", {}), ("policy",)) is None and other_ns.rejected["bad_signature"] == 1
    assert a.open(a.seal("policy", {}), ("policy",)) is None and sum(a.rejected.values()) == 0  # own echo
    assert b.open(a.seal("counts", {}), ("policy",)) is None and b.rejected["malformed"] == 1  # wrong kind


def test_a_flood_of_made_up_origins_blinds_neither_logs_nor_health(stubs, redis_url, tmp_path, caplog,
                                                                    monkeypatch):
    """The issue's blinding: 1,100 unsigned and 1,100 badly signed messages with distinct claimed origins,
    then a real replica with the wrong key. The log says each reason once (with the count since, when the
    minute is up); /health still shows the wrong-key replica, as a count and a hash, no attacker text."""
    (p0, d0, d1, _), _ = stubs
    monkeypatch.setattr(auth, "LOG_EVERY_S", 2.0)  # the minute, shortened
    a, sa = _replica([p0], [d0, d1], redis_url)
    r = redis_py.Redis.from_url(redis_url)
    ns = a.state.shared.ns
    keyfile = tmp_path / "other.key"
    keyfile.write_text("9mzM9C6EL3-jKnsHbIUwrOSRbB3QOuzlNETndu7vsoE")
    keyfile.chmod(0o600)
    c = sc = None
    try:
        assert _until(lambda: a.state.shared.sync_age_s() < 0.5)
        caplog.set_level("WARNING", logger="eldr.proxy.state")
        t0 = time.monotonic()
        for i in range(1100):
            r.publish(f"{ns}:admin", orjson.dumps({"o": f"evil\n{i}<script>", "k": "policy", "p": {}}))
            r.publish(f"{ns}:admin", _sealed(b"x" * 32, ns, f"evil-{i}", "policy", {"policy": "jsq"}))
        assert _until(lambda: a.state.shared.rejected["bad_signature"] >= 1100 and
                      a.state.shared.rejected["unsigned"] >= 1100, 10)
        c, sc = _replica([p0], [d0, d1], redis_url, state_key_file=str(keyfile))
        c_hash = origin_hash(c.state.shared.replica_id)
        assert _until(lambda: c_hash in a.state.shared.env.wrong_key)
        wk = httpx.get(sa.url + "/health").json()["state_wrong_key"]
        assert wk["origins"] >= 1101 and not wk["saturated"]
        def lines(reason):
            return [rec for rec in caplog.records if getattr(rec, "event", None) == "state_rejected"
                    and rec.reason == reason and rec.replica == a.state.shared.replica_id]  # A's lines, not C's

        bound = (time.monotonic() - t0) / 2.0 + 1  # one line per reason per (shortened) minute
        assert 1 <= len(lines("unsigned")) <= bound and 1 <= len(lines("bad_signature")) <= bound
        time.sleep(2.1)  # the minute is up: the next rejection is logged, with the count since the last line
        n = len(lines("unsigned"))
        r.publish(f"{ns}:admin", b"unsigned again")
        assert _until(lambda: len(lines("unsigned")) == n + 1)
        assert lines("unsigned")[-1].ignored_since_last_log >= 1
        # nothing lost: every rejection is a line or counted in the next one
        assert sum(1 + rec.ignored_since_last_log for rec in lines("unsigned")) == a.state.shared.rejected["unsigned"]
        text = caplog.text + str(httpx.get(sa.url + "/health").json())
        assert "evil" not in text and "<script>" not in text  # the attacker's text is nowhere
    finally:
        sa.stop()
        if sc is not None:
            sc.stop()
        r.close()
