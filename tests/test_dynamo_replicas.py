"""Two eldr router replicas inside one Dynamo deployment share their state as the proxy replicas do (signed
counts and live sets over a real redis-server, atomic reservation of each decode slot): a burst that reaches
both replicas at once is still spread over the decode instances (the herd test of tests/test_proxy_reserve.py).
Skipped without ``.venv-dynamo`` (``make venv-dynamo``)."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest
from _proxy_util import build_routing

from eldr_cli.testing.dynamo import MODEL, DynamoCluster, dynamo_missing

pytestmark = [pytest.mark.slow, pytest.mark.dynamo,
              pytest.mark.skipif(dynamo_missing() is not None, reason=str(dynamo_missing()))]

BURST = 18
TOKENS = 40
DELAY_MS = 50  # each stream stays in flight about 2 s: the whole burst runs at once


def _stream(url: str, i: int, out: list[int]) -> None:
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": f"w{i % 50} hello world " * (1 + i % 7),
                            "max_tokens": TOKENS, "stream": True}) as r:
        for _ in r.iter_bytes():
            pass
        out.append(r.status_code)


def _running_when_all_started(rows: list[dict], instances: list[str]) -> list[int]:
    """Requests running on each instance at the moment the last one of the burst started."""
    t = max(r["t_start"] for r in rows)
    return [sum(r["instance_id"] == i and r["t_start"] <= t < r["t_end"] for r in rows) for i in instances]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from eldr_cli.proxy.replicas.redis_server import RedisServer

    tmp = tmp_path_factory.mktemp("replicas")
    routing = build_routing(tmp / "routing", decoders=3)
    with RedisServer() as redis:
        c = DynamoCluster(tmp / "dynamo", routing=routing, n_decode=3, routers=2, delay_ms=DELAY_MS,
                          router_args=("--state", f"redis://{redis.host}:{redis.port}/0", "--state-reserve-ms",
                                       "1000"),
                          env={"ELDR_STATE_KEY": secrets.token_urlsafe(32)})
        try:
            c.wait_ready()
            yield c
        finally:
            c.close()


def test_a_burst_on_two_replicas_is_spread_and_every_slot_reserved(replicas):
    c = replicas
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and not all(s["replicas"] == 2 for s in c.stats()):
        time.sleep(0.5)
    before = c.stats()
    assert len(before) == 2 and all(s["replicas"] == 2 and s["policy"] == "eldr-live" for s in before)
    done = len(c.decode_rows())
    out: list[int] = []
    ts = [threading.Thread(target=_stream, args=(c.url, i, out)) for i in range(BURST)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [200] * BURST
    rows = c.decode_rows()[done:]
    assert len(rows) == BURST and all(r["ended"] == "done" for r in rows)
    after = c.stats()
    by_replica = [a["counts"]["requests"] - b["counts"].get("requests", 0) for a, b in zip(after, before, strict=True)]
    assert sum(by_replica) == BURST and min(by_replica) > 0  # the frontend sent the burst to both replicas
    ok = [a["reservations"]["ok"] - b["reservations"]["ok"] for a, b in zip(after, before, strict=True)]
    assert sum(ok) == BURST  # every decode slot reserved atomically in Redis, none decided alone
    running = _running_when_all_started(rows, after[0]["instances"])
    assert sum(running) == BURST
    # eldr-live's load cap (max(2, ceil(25% of the mean 6)) = 2) on Redis's exact counts, + 1 for a request
    # whose slot was reserved but not yet running: the proxy's bound (tests/test_proxy_reserve.py)
    assert max(running) - min(running) <= 3, running
    t0 = time.monotonic()  # every slot given back, both replicas' loads back to 0
    while time.monotonic() - t0 < 10 and any(s["in_flight"] or any(s["loads"]) for s in c.stats()):
        time.sleep(0.5)
    assert all(s["in_flight"] == 0 and s["loads"] == [0, 0, 0] for s in c.stats())
