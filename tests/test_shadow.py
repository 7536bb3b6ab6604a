"""Shadow mode through a real proxy in front of stub PD workers: the live policy routes, each shadow decides in
the same path on its own counterfactual state (checked against an independent router fed the same requests),
its choices are logged and counted, and a shadow the artifact cannot build is refused while the proxy serves."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.errors import EldrError
from eldr_cli.proxy import build_config
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.testing.stub_worker import fake_counts

PROMPTS = [f"shadow request {i}: topic {i * 11}" for i in range(16)]


@pytest.fixture(scope="module")
def routing3(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("routing3"), decoders=3)


def test_shadows_decide_on_their_own_state_and_are_logged(routing3, tmp_path):
    c = Cluster(routing=str(routing3), policy="jsq", shadow=["eldr-live", "eldr"],
                decision_log=str(tmp_path / "d.jsonl"))
    try:
        with httpx.Client() as h:
            for p in PROMPTS:
                r = h.post(c.url + "/v1/completions", json={"prompt": p, "max_tokens": 2})
                assert r.status_code == 200
                assert r.headers["x-eldr-decode-worker"] == "d0"  # JSQ, every decoder idle: the live choice
            health = h.get(c.url + "/health").json()["shadow"]
        c.app.decision_log.flush()
        rows = [json.loads(x) for x in open(c.cfg.decision_log)]
        n_live = c.metric("eldr_proxy_shadow_decisions_total", shadow="eldr-live")
        agree = c.metric("eldr_proxy_shadow_agree_total", shadow="eldr-live")
        steps = {(s, a): c.metric("eldr_proxy_shadow_predicted_step_ms", shadow="eldr-live", assignment=a, worker=s)
                 for s in ("d0", "d1", "d2") for a in ("live", "shadow")}
        assert c.metric("eldr_proxy_shadow_decision_seconds_count") == len(PROMPTS)
    finally:
        c.close()
    model = RoutingModel.load(routing3)
    live, band = make_router("eldr-live", 3, model=model), make_router("eldr", 3, model=model)
    for i, (row, p) in enumerate(zip(rows, PROMPTS, strict=True)):
        assert row["policy"] == "jsq" and row["chosen"] == 0
        tokens = len(p.split()) + 1  # the stub's prompt tokens + half of max_tokens=2
        # the shadow's own state: each request was finished before the next, as if the shadow had routed it
        want = live.decide(fake_counts(p), [0, 0, 0], tokens=tokens)
        live.on_dispatch(want, f"r{i}")
        live.on_finish(want.worker, f"r{i}")
        sh = row["shadow"]
        assert sh["eldr-live"]["chosen"] == want.worker and len(sh["eldr-live"]["predicted_ms"]) == 3
        assert sh["eldr"]["chosen"] == band.decide(fake_counts(p), [0, 0, 0]).worker
        assert sh["eldr-live"]["agree"] == (want.worker == 0)
        # each assignment's predicted next step per decoder: only the decoder holding this request runs one
        assert [x > 0 for x in sh["eldr-live"]["step_ms"]] == [k == want.worker for k in range(3)]
        assert [x > 0 for x in sh["eldr-live"]["live_step_ms"]] == [True, False, False]
    assert n_live == len(PROMPTS) and agree == sum(r["shadow"]["eldr-live"]["agree"] for r in rows)
    assert health["policies"] == ["eldr-live", "eldr"] and health["refused"] == {}
    assert all(v == 0 for v in steps.values())  # nothing in flight any more: idle decoders run no step


def test_concurrent_requests_give_their_shadow_placements_back(routing3):
    c = Cluster(routing=str(routing3), policy="jsq", shadow=["eldr-live"], stub_kw={"token_delay_s": 0.02})
    try:
        def send(p):
            httpx.post(c.url + "/v1/completions", json={"prompt": p, "max_tokens": 6}, timeout=30)

        ts = [threading.Thread(target=send, args=(p,)) for p in PROMPTS[:9]]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert c.settle() == 0
        decided = c.metric("eldr_proxy_shadow_decisions_total", shadow="eldr-live")
        after = c.metric("eldr_proxy_shadow_inflight", shadow="eldr-live")
        shadow = c.app.shadow.shadows[0]
    finally:
        c.close()
    assert decided == 9 and after == 0 and not shadow.where  # each finish took the shadow's placement back
    assert shadow.router.policy.is_empty()  # and emptied its live set


def test_a_shadow_the_artifact_cannot_build_is_refused_and_the_proxy_serves(caplog):
    with caplog.at_level(logging.WARNING, logger="eldr.proxy"):
        c = Cluster(policy="jsq", shadow=["eldr", "round-robin"])  # no routing artifact: eldr cannot be built
    try:
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
        health = httpx.get(c.url + "/health").json()["shadow"]
        assert c.metric("eldr_proxy_shadow_decisions_total", shadow="round-robin") == 1
    finally:
        c.close()
    assert health["policies"] == ["round-robin"] and "routing artifact" in health["refused"]["eldr"]
    assert len([r for r in caplog.records if "shadow policy eldr refused" in r.getMessage()]) == 1


def test_unknown_shadow_is_a_user_error():
    with pytest.raises(EldrError, match="unknown shadow policy 'best'"):
        build_config(None, prefill=["http://a:1"], decode=["http://b:1"], policy="jsq", shadow=["best"])
