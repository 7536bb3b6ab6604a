"""serve-proxy against stub PD workers: protocol, routing decision, baselines, bad input, admin, config."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.errors import EldrError
from eldr_cli.handoff import SIGNATURE_KEY
from eldr_cli.proxy import ProxyConfig, build_config, create_app
from eldr_cli.proxy.health import parse_running
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.policies import DomainPolicy
from eldr_cli.testing.stub_worker import fake_counts

TOKEN = "pP3uG-8vQk2Zr6XyT1bW0nLh5sJd9aFcE4mKo7iRqYw"  # an admin token must hold 256 bits (issue 36): 43 base64url
PROMPTS = [f"request {i}: explain topic number {i * 7} in a few words" for i in range(12)]


@pytest.fixture(scope="module")
def routing3(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("routing3"), decoders=3)


@pytest.fixture(scope="module")
def routing4(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("routing4"), decoders=4, seed=1)


@pytest.fixture()
def cluster(routing3, tmp_path):
    c = Cluster(routing=str(routing3), policy="eldr", admin_token=TOKEN,
                decision_log=str(tmp_path / "decisions.jsonl"), max_body_bytes=4096)
    yield c
    c.close()


def test_pd_protocol_legs_and_usage(cluster):
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 7, "min_tokens": 3,
            "stream_options": {"include_usage": True}, "stream": False}
    r = httpx.post(cluster.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ans = r.json()
    # prefill leg: stream=false, max_tokens=1, min_tokens/stream_options removed, remote-decode params
    pre = [b for s in cluster.prefill for b in s.prefill_bodies]
    assert len(pre) == 1
    assert pre[0]["stream"] is False and pre[0]["max_tokens"] == 1
    assert "min_tokens" not in pre[0] and "stream_options" not in pre[0]
    assert pre[0]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_engine_id": None, "remote_block_ids": None,
                                            "remote_host": None, "remote_port": None}
    # decode leg: the original request with the prefill's kv_transfer_params minus the signature
    wid = r.headers["x-eldr-decode-worker"]
    dec = cluster.decode[int(wid[1:])].decode_bodies
    assert len(dec) == 1
    ktp = dec[0]["kv_transfer_params"]
    assert SIGNATURE_KEY not in ktp
    assert ktp["do_remote_prefill"] is True and ktp["remote_block_ids"] == [1, 2, 3]
    assert dec[0]["max_tokens"] == 7 and dec[0]["min_tokens"] == 3
    # usage counts the prompt once (the decode worker's usage, not prefill + decode)
    n_prompt = len(PROMPTS[0].split())
    assert ans["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7}
    assert len(ans["choices"][0]["text"].split()) == 7
    assert r.headers["x-request-id"]


# Eq. 2's per-cell transforms, written out here so the expected decisions do not come from the router's code
HAND_TRANSFORM = {"count": lambda c, w: c, "count-idf": lambda c, w: c * w, "sqrt": lambda c, w: np.sqrt(c),
                  "binary": lambda c, w: (c > 0).astype(float)}


def _hand_band_choice(model: RoutingModel, counts: np.ndarray) -> int:
    """§4.3.2 with every decoder idle: the band's least loaded is the centroid of the largest cosine."""
    x = HAND_TRANSFORM[model.transform](counts[model.mask].astype(float), model.weights[model.mask]).ravel()
    sims = [float(c @ x) / float(np.linalg.norm(x)) for c in model.centroids]
    return max(range(len(sims)), key=lambda k: (sims[k], -k))


def test_eldr_decision_is_the_shared_band_decision(cluster, routing3):
    model = RoutingModel.load(routing3)
    router = make_router("eldr", 3, model=model)
    seen = set()
    for p in PROMPTS:
        r = httpx.post(cluster.url + "/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 2})
        assert r.status_code == 200
        # sequential requests: every decoder has 0 in flight at decision time
        expected = _hand_band_choice(model, fake_counts(p))
        assert r.headers["x-eldr-decode-worker"] == f"d{expected}"
        assert router.decide(fake_counts(p), [0, 0, 0]).worker == expected  # the factory's router agrees
        seen.add(expected)
    assert len(seen) > 1  # the prompts reach more than one decoder: the choice is not a constant
    assert cluster.metric("eldr_proxy_decisions_total", policy="eldr") == len(PROMPTS)
    assert cluster.metric("eldr_proxy_signature_missing_total") == 0
    assert cluster.metric("eldr_proxy_band_size_count") == len(PROMPTS)
    # the decision log holds what offline replay needs
    cluster.app.decision_log.flush()
    rows = [json.loads(x) for x in open(cluster.cfg.decision_log)]
    assert len(rows) == len(PROMPTS)
    for row, p in zip(rows, PROMPTS, strict=True):
        sims = np.asarray(row["similarities"])
        np.testing.assert_allclose(sims, model.centroids @ model.signature(fake_counts(p)), rtol=1e-9)
        assert row["chosen"] in row["band"] and row["loads"] == [0, 0, 0] and row["signature"] == "ok"
        assert row["request_id"] and row["worker"] == f"d{row['chosen']}"


def test_missing_or_malformed_signature_goes_to_jsq_and_is_counted(cluster):
    for fault, reason in (("prefill_nosig", "missing"), ("prefill_badsig", "malformed")):
        r = httpx.post(cluster.url + "/v1/completions",
                       json={"prompt": f"[[fault:{fault}]] hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.headers["x-eldr-decode-worker"] == "d0"  # JSQ with all idle -> lowest index
        assert cluster.metric("eldr_proxy_signature_missing_total", reason=reason) == 1
        dec = cluster.decode[0].decode_bodies[-1]
        assert SIGNATURE_KEY not in dec["kv_transfer_params"]


def test_streaming_chat_through_openai_client(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    stream = client.chat.completions.create(model="m", messages=msgs, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
    deltas, usage = [], None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            deltas.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    assert len(deltas) == 6  # token by token
    direct = httpx.post(cluster.urls[2] + "/v1/chat/completions",
                        json={"model": "m", "messages": msgs, "max_tokens": 6}).json()
    assert "".join(deltas) == direct["choices"][0]["message"]["content"]
    assert usage.prompt_tokens == len(PROMPTS[3].split()) and usage.completion_tokens == 6
    full = client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    assert full.choices[0].message.content == "".join(deltas)
    assert cluster.settle() == 0 and sum(cluster.inflight()) == 0


@pytest.mark.parametrize("raw, reason", [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "m"}', "'prompt'"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
])
def test_bad_input_is_400_with_reason(cluster, raw, reason):
    r = httpx.post(cluster.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert reason in r.json()["error"]["message"]
    assert sum(s.stats["prefill"] for s in cluster.prefill) == 0


def test_chat_schema_and_body_limit(cluster):
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    # a chunked body without content-length is cut off too
    r = httpx.post(cluster.url + "/v1/completions", content=iter([b'{"prompt": "', b"y" * 5000, b'"}']))
    assert r.status_code == 413
    assert cluster.settle() == 0 and cluster.app.state.outcomes == {"bad_request": 1, "too_large": 2}


def test_models_health_metrics_404(cluster):
    assert httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"] == "stub-model"
    h = httpx.get(cluster.url + "/health").json()
    assert h["status"] == "ok" and h["prefill_up"] == 2 and h["decode_up"] == 3 and h["policy"] == "eldr"
    assert [w["id"] for w in h["workers"]] == ["p0", "p1", "d0", "d1", "d2"]
    assert httpx.get(cluster.url + "/nope").status_code == 404
    assert httpx.get(cluster.url + "/v1/completions").status_code == 405
    assert "eldr_proxy_inflight" in httpx.get(cluster.url + "/metrics").text


def test_prefix_hash_keeps_a_prefix_on_one_prefill_worker(cluster):
    shared = "You are a helpful assistant. " * 40  # longer than the hashed leading blocks
    for i in range(6):
        r = httpx.post(cluster.url + "/v1/completions", json={"prompt": shared + f"question {i}", "max_tokens": 1})
        assert r.status_code == 200
    counts = sorted(s.stats["prefill"] for s in cluster.prefill)
    assert counts == [0, 6]


def test_prefix_hash_falls_back_to_least_loaded_when_overloaded():
    from eldr_cli.proxy.workers import WorkerPool
    from eldr_cli.routing.prefill import PrefixHashPrefill

    pool = WorkerPool("prefill", ["http://a", "http://b", "http://c"])
    ph = PrefixHashPrefill(block_chars=16, blocks=2)
    home = ph.choose(pool, "same prefix for everyone")
    assert ph.choose(pool, "same prefix for everyone") is home
    home.inflight = 2  # average 2/3: home is above 1.25x average
    other = ph.choose(pool, "same prefix for everyone")
    assert other is not home and other.inflight == 0
    for w in pool.workers:
        w.inflight = 4
    home.inflight = 5  # 5 <= 1.25 * 4.33: stays home
    assert ph.choose(pool, "same prefix for everyone") is home


def test_domain_policy_uses_header(routing3):
    c = Cluster(routing=str(routing3), policy="domain")
    try:
        model = RoutingModel.load(routing3)
        groups = DomainPolicy(3, domain_share=model.domain_share).groups
        for dom, workers in groups.items():
            r = httpx.post(c.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers={"X-Eldr-Domain": dom})
            assert r.status_code == 200
            assert int(r.headers["x-eldr-decode-worker"][1:]) == workers[0]  # JSQ within the group, all idle
    finally:
        c.close()


def test_round_robin_and_health_checks(routing3):
    c = Cluster(policy="round-robin", health_fail_threshold=2, health_success_threshold=2)
    try:
        got = [httpx.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
               .headers["x-eldr-decode-worker"] for _ in range(6)]
        assert got == ["d0", "d1", "d2"] * 2
        c.decode[1].healthy = False
        c.proxy.call(c.app.check_health_once())
        assert c.app.state.decode.workers[1].healthy  # one failure < threshold 2
        c.proxy.call(c.app.check_health_once())
        assert not c.app.state.decode.workers[1].healthy
        got = [httpx.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
               .headers["x-eldr-decode-worker"] for _ in range(6)]
        assert "d1" not in got
        assert c.metric("eldr_proxy_worker_up", worker="d1") == 0
        c.decode[1].healthy = True
        c.proxy.call(c.app.check_health_once())
        assert not c.app.state.decode.workers[1].healthy
        c.proxy.call(c.app.check_health_once())
        assert c.app.state.decode.workers[1].healthy
        assert c.metric("eldr_proxy_health_transitions_total", worker="d1") == 2
    finally:
        c.close()


def test_scrape_running_combines_with_inflight():
    assert parse_running('# HELP x\nvllm:num_requests_running{model_name="a"} 3.0\n'
                         'vllm:num_requests_running{model_name="b"} 2\n') == 5
    assert parse_running("other 1\n") is None
    from eldr_cli.proxy.workers import Worker

    w = Worker("d0", "decode", "http://x", inflight=1, scraped_running=4)
    assert w.load(True) == 4 and w.load(False) == 1


def test_admin_endpoints(cluster, routing3, routing4):
    url = cluster.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(url + "/admin/policy", json={"policy": "jsq"}).status_code == 401
    assert httpx.post(url + "/admin/policy", json={"policy": "jsq"},
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    r = httpx.post(url + "/admin/policy", json={"policy": "bogus"}, headers=auth)
    assert r.status_code == 400 and "unknown policy" in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/policy", json={"policy": "eldr", "tau": 0.3}, headers=auth)
    assert r.status_code == 200 and r.json()["tau"] == 0.3
    assert cluster.metric("eldr_proxy_policy_info", policy="eldr", tau="0.3") == 1
    # adding a decoder under eldr with a K=3 artifact is refused with the way out
    r = httpx.post(url + "/admin/workers", json={"action": "add", "role": "decode", "url": "http://127.0.0.1:9"},
                   headers=auth)
    assert r.status_code == 409 and "K=3" in r.json()["error"]["message"]
    # reload with a K=4 artifact while the pool has 3 decoders: refused
    r = httpx.post(url + "/admin/reload", json={"routing": str(routing4)}, headers=auth)
    assert r.status_code == 409 and "K=4" in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/reload", json={"routing": "/does/not/exist"}, headers=auth)
    assert r.status_code == 400
    # atomic reload: K=4 artifact together with a 4-worker decode pool (3 kept + 1 new)
    new = cluster.urls[2:] + [cluster.urls[0]]  # reuse a stub URL as the 4th decoder
    r = httpx.post(url + "/admin/reload", json={"routing": str(routing4), "decode": new}, headers=auth)
    assert r.status_code == 200, r.text
    assert [w["id"] for w in r.json()["decode"]] == ["d0", "d1", "d2", "d3"] and r.json()["k"] == 4
    assert httpx.post(url + "/v1/completions", json={"prompt": "after reload", "max_tokens": 1}).status_code == 200
    # remove a decoder under jsq; ids stay stable
    httpx.post(url + "/admin/policy", json={"policy": "jsq"}, headers=auth)
    r = httpx.post(url + "/admin/workers", json={"action": "remove", "role": "decode", "url": cluster.urls[3]},
                   headers=auth)
    assert r.status_code == 200 and [w["id"] for w in r.json()["decode"]] == ["d0", "d2", "d3"]
    r = httpx.post(url + "/admin/workers", json={"action": "add", "role": "decode", "url": cluster.urls[3]},
                   headers=auth)
    assert [w["id"] for w in r.json()["decode"]] == ["d0", "d2", "d3", "d4"]
    assert httpx.get(url + "/admin/workers", headers=auth).json()["policy"] == "jsq"
    # back to eldr: K=4 matches 4 decoders
    assert httpx.post(url + "/admin/policy", json={"policy": "eldr"}, headers=auth).status_code == 200


def test_admin_disabled_without_token(routing3):
    c = Cluster(policy="jsq")
    try:
        r = httpx.post(c.url + "/admin/policy", json={"policy": "jsq"}, headers={"Authorization": "Bearer x"})
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]
    finally:
        c.close()


def test_config_files_and_errors(tmp_path, routing3, routing4):
    y = tmp_path / "p.yaml"
    y.write_text(f"routing: {routing3}\nprefill: http://127.0.0.1:1\ndecode: [http://127.0.0.1:2, "
                 f"http://127.0.0.1:3, http://127.0.0.1:4]\npolicy: eldr\ntau: 0.2\nport: 18250\n")
    cfg = build_config(y, port=18251)
    assert cfg.port == 18251 and cfg.tau == 0.2 and cfg.prefill == ["http://127.0.0.1:1"] and cfg.host == "127.0.0.1"
    t = tmp_path / "p.toml"
    t.write_text('prefill = ["http://127.0.0.1:1"]\ndecode = ["http://127.0.0.1:2"]\npolicy = "p2c"\n'
                 'max-body-bytes = 2048\n')
    assert build_config(t).max_body_bytes == 2048
    bad = tmp_path / "bad.toml"
    bad.write_text('prefil = ["http://x"]\n')
    with pytest.raises(EldrError, match="unknown key 'prefil'"):
        build_config(bad)
    with pytest.raises(EldrError, match="K=4 centroids but there are 3"):
        create_app(ProxyConfig(routing=str(routing4), policy="eldr", prefill=["http://a"],
                               decode=["http://b", "http://c", "http://d"]))
    with pytest.raises(EldrError, match="needs a routing artifact"):
        build_config(None, prefill=["http://a"], decode=["http://b"], policy="eldr")


def test_cli_refuses_k_mismatch(routing4):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "eldr_cli", "serve-proxy", "--routing", str(routing4),
                        "--policy", "eldr", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "K=4" in r.stderr and "Traceback" not in r.stderr


def test_decision_log_parquet_parts(tmp_path):
    import polars as pl

    from eldr_cli.proxy.decisionlog import DecisionLog

    log = DecisionLog(str(tmp_path / "dec.parquet"), rows_per_part=3)
    for i in range(5):
        log.write({"ts": float(i), "request_id": f"r{i}", "policy": "eldr", "tau": 0.1, "signature": "ok",
                   "similarities": np.array([0.5, 0.25 * i]), "band": np.array([0, 1]), "loads": [i, 0],
                   "chosen": i % 2, "worker": f"d{i % 2}", "domain": None, "decision_us": 12.5})
    log.close()
    parts = sorted(tmp_path.glob("dec-*.parquet"))
    assert [p.name for p in parts] == ["dec-00000.parquet", "dec-00001.parquet"]
    df = pl.concat([pl.read_parquet(p) for p in parts])
    assert df["request_id"].to_list() == [f"r{i}" for i in range(5)]
    assert df["similarities"].to_list()[4] == [0.5, 1.0] and df["loads"].to_list()[2] == [2, 0]


def test_a_proxy_with_a_routing_artifact_compiles_the_handoffs_loops_at_start_not_in_a_swap(routing3, monkeypatch):
    """Compiling the signature loops took 11 s on a fresh machine (more when loaded): done in an admin swap to
    eldr it stalled the event loop past the bench's admin timeout (`make demo` failed). A proxy that loads a
    routing artifact compiles them when it is built, whatever policy it starts with; one without does not."""
    import eldr_cli.routing.compiled as compiled
    from eldr_cli.handoff import WIRE_DTYPES

    calls: list = []
    monkeypatch.setattr(compiled, "warm", lambda *a, **k: calls.append((a, k)))
    decode = [f"http://127.0.0.1:{p}" for p in (9, 10, 11)]  # never contacted: nothing is started
    create_app(ProxyConfig(prefill=["http://127.0.0.1:12"], decode=decode, routing=str(routing3), policy="round-robin"))
    assert ((WIRE_DTYPES,), {"read_only": True}) in calls
    calls.clear()
    create_app(ProxyConfig(prefill=["http://127.0.0.1:12"], decode=decode, policy="jsq"))
    assert calls == []


def test_the_bench_says_the_admin_swap_timed_out_instead_of_an_empty_reason(monkeypatch):
    """asyncio's timeout has no message: the sweep printed 'cannot reach the proxy admin endpoint at URL: '."""
    import asyncio
    import socket

    import aiohttp

    import eldr_cli.bench.serve as serve
    from eldr_cli.errors import EldrError

    monkeypatch.setattr(serve, "ADMIN_TIMEOUT_S", 0.3)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # accepts the connection, never answers
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"

    async def go():
        async with aiohttp.ClientSession() as s:
            await serve._switch_policy(s, url, "eldr", None, TOKEN)

    try:
        with pytest.raises(EldrError) as e:
            asyncio.run(go())
    finally:
        srv.close()
    assert "did not answer POST /admin/policy ('eldr') within 0.3 s" in str(e.value)
