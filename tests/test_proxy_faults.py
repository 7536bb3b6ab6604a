"""serve-proxy fault handling against stub workers: retries, timeouts, dropped streams, disconnects,
and the invariant that every request ends in exactly one terminal outcome with counters back to 0."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from _proxy_util import Cluster


@pytest.fixture()
def cluster():
    c = Cluster(policy="jsq", prefill_timeout_s=0.5, stub_kw={"timeout_sleep_s": 3.0})
    yield c
    c.close()


def _complete(url, prompt, **kw):
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4, **kw},
                      timeout=20)


def test_prefill_error_retries_once_on_another_worker(cluster):
    cluster.prefill[0].fail = "500"
    codes = [_complete(cluster.url, f"prompt {i}").status_code for i in range(10)]
    assert codes == [200] * 10
    failed = cluster.prefill[0].stats["prefill_500"]
    assert failed > 0  # some prompts hash to the failing worker ...
    assert cluster.metric("eldr_proxy_retries_total", role="prefill") == failed  # ... and were retried once
    assert cluster.metric("eldr_proxy_upstream_errors_total", role="prefill", worker="p0", kind="status") == failed


def test_prefill_errors_everywhere_give_502_with_reason(cluster):
    for s in cluster.prefill:
        s.fail = "500"
    r = _complete(cluster.url, "anything")
    assert r.status_code == 502
    msg = r.json()["error"]["message"]
    assert "prefill failed" in msg and "p0" in msg and "p1" in msg and "HTTP 500" in msg
    assert sum(s.stats["prefill_500"] for s in cluster.prefill) == 2  # one try + one retry, no more
    assert cluster.settle() == 0 and sum(cluster.inflight()) == 0
    assert cluster.app.state.outcomes == {"upstream_error": 1}


def test_prefill_timeout_then_retry_then_502(cluster):
    r = _complete(cluster.url, "[[fault:prefill_timeout]] slow prompt")
    assert r.status_code == 502 and "no answer within 0.5 s" in r.json()["error"]["message"]
    # both legs ended by the proxy's 0.5 s timeout, not by the stub's 3 s sleep (counted, not timed:
    # a wall-clock bound fails on a loaded machine)
    assert cluster.metric("eldr_proxy_upstream_errors_total", role="prefill", kind="timeout") == 2
    assert sum(cluster.inflight()) == 0


def test_prefill_4xx_is_relayed_not_retried(cluster):
    r = _complete(cluster.url, "[[fault:prefill_400]] x")
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"]
    assert sum(s.stats["prefill_400"] for s in cluster.prefill) == 1
    assert cluster.metric("eldr_proxy_retries_total", role="prefill") == 0
    assert cluster.settle() == 0 and cluster.app.state.outcomes == {"bad_request": 1}


def test_decode_error_is_502_and_counters_stay_right(cluster):
    r = _complete(cluster.url, "[[fault:decode_500]] x")
    assert r.status_code == 502 and "answered HTTP 500" in r.json()["error"]["message"]
    r = _complete(cluster.url, "[[fault:decode_500]] x", stream=True)
    assert r.status_code == 502
    assert cluster.settle() == 0
    assert sum(cluster.inflight()) == 0 and cluster.app.state.outcomes == {"upstream_error": 2}


def test_decode_dies_mid_stream_client_gets_error_event(cluster):
    import openai

    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=20,
                      json={"prompt": "[[fault:decode_drop]] y", "max_tokens": 10, "stream": True}) as r:
        assert r.status_code == 200
        lines = [l for l in r.iter_lines() if l]
    assert len(lines) == 6  # 5 tokens, then the error event; no [DONE]
    assert lines[-1].startswith("data: ") and '"error"' in lines[-1] and "abnormally" in lines[-1]
    assert "[DONE]" not in lines[-1]
    # the official client raises on the error event instead of returning a truncated answer
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="m", prompt="[[fault:decode_drop]] z", max_tokens=10, stream=True):
            pass
    assert cluster.settle() == 0 and sum(cluster.inflight()) == 0
    assert cluster.app.state.outcomes == {"stream_error": 2}
    assert cluster.metric("eldr_proxy_upstream_errors_total", role="decode", kind="dropped") == 2


def test_decode_worker_unreachable_retries_on_another(cluster):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    w = cluster.app.state.decode.workers[0]
    w.session = cluster.proxy.call(_pool(f"http://127.0.0.1:{port}"))
    r = _complete(cluster.url, "hello")
    assert r.status_code == 200 and r.headers["x-eldr-decode-worker"] != "d0"
    assert cluster.metric("eldr_proxy_retries_total", role="decode") == 1
    assert sum(cluster.inflight()) == 0


async def _pool(url):
    from eldr_cli.proxy.upstream import HttpPool

    return HttpPool(url)


def test_client_disconnect_cancels_the_upstream_stream():
    c = Cluster(policy="jsq", stub_kw={"token_delay_s": 0.05})
    try:
        with httpx.stream("POST", c.url + "/v1/completions", timeout=20,
                          json={"prompt": "long answer", "max_tokens": 200, "stream": True}) as r:
            it = r.iter_lines()
            got = [next(it) for _ in range(3)]
            assert got[0].startswith("data: ")
        # the client has gone; the proxy must cancel the decode leg and the worker must see it
        t0 = time.monotonic()
        while sum(s.stats["decode_cancelled"] for s in c.decode) == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert sum(s.stats["decode_cancelled"] for s in c.decode) == 1
        assert sum(s.stats["decode_ok"] for s in c.decode) == 0
        assert c.settle() == 0 and sum(c.inflight()) == 0
        assert c.app.state.outcomes == {"cancelled": 1}
    finally:
        c.close()


def test_client_disconnect_during_prefill_is_cancelled_once(cluster):
    with pytest.raises(httpx.ReadTimeout):
        _ = httpx.post(cluster.url + "/v1/completions", timeout=0.2,
                       json={"prompt": "[[fault:prefill_timeout]] q", "max_tokens": 3})
    assert cluster.settle() == 0
    assert cluster.app.state.outcomes == {"cancelled": 1} and sum(cluster.inflight()) == 0
    assert cluster.metric("eldr_proxy_requests_total", outcome="cancelled") == 1


def test_mixed_fault_burst_every_request_has_one_outcome():
    import asyncio

    c = Cluster(policy="jsq", prefill_timeout_s=0.3, stub_kw={"timeout_sleep_s": 1.0, "token_delay_s": 0.002})
    faults = ["", "", "", "[[fault:prefill_500]]", "[[fault:prefill_timeout]]", "[[fault:decode_500]]",
              "[[fault:decode_drop]]", "[[fault:prefill_nosig]]"]
    n = 160
    responded = []

    async def one(client, i):
        body = {"prompt": f"{faults[i % len(faults)]} req {i}", "max_tokens": 8, "stream": i % 2 == 0}
        try:
            if i % 11 == 0:  # the client gives up early
                await client.post(c.url + "/v1/completions", json=body, timeout=0.01)
            async with client.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as r:
                responded.append(r.status_code)
                async for _ in r.aiter_bytes():
                    pass
        except httpx.HTTPError:
            pass

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    try:
        asyncio.run(run())
        assert c.settle(10) == 0
        st = c.app.state
        assert sum(st.outcomes.values()) == st.started  # exactly one terminal outcome each
        assert st.started >= len(responded) >= n - n // 11 - 1
        assert sum(c.inflight()) == 0
        assert st.outcomes.get("ok", 0) > 0 and st.outcomes.get("upstream_error", 0) > 0
        assert st.outcomes.get("stream_error", 0) > 0
        assert c.metric("eldr_proxy_requests_total") == st.started
    finally:
        c.close()


def test_upstream_pool_resends_on_a_connection_the_server_closed():
    """A kept-alive connection closed by the worker while idle is replaced transparently."""
    import asyncio

    from eldr_cli.proxy.upstream import HttpPool, UpstreamError

    async def run():
        served = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            served.append(1)
            if head.startswith(b"GET /big"):  # larger than the client's read-pause high-water mark
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(40):
                    writer.write(b"10000\r\n" + b"x" * 65536 + b"\r\n")
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()  # closes the "kept-alive" connection behind the client's back

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        pool = HttpPool(f"http://127.0.0.1:{port}")
        bodies = []
        for _ in range(3):
            r = await pool.request("GET", "/x", timeout=5)
            bodies.append(await r.read(5))
            r.release()
            await asyncio.sleep(0.2)
        r = await pool.request("GET", "/big", timeout=5)
        big = await r.read(5)
        r.release()
        bodies.append(len(big))
        await pool.close()
        srv.close()
        with pytest.raises(UpstreamError) as e:
            await HttpPool(f"http://127.0.0.1:{port}").request("GET", "/x")
        return bodies, served, e.value.kind

    bodies, served, kind = asyncio.run(run())
    assert bodies == [b"ok"] * 3 + [40 * 65536] and len(served) == 4
    assert kind == "connect"
