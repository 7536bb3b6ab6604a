"""eldr-live (issue 21): the decode-activation model, the cost-aware choice, the live set's lifecycle in the
simulator and the proxy, replicas' shared vectors, and one decision object for proxy and simulator."""

from __future__ import annotations

import contextlib
import json

import httpx
import numpy as np
import pytest
from _proxy_util import Cluster, build_routing

from eldr_cli.errors import EldrError
from eldr_cli.method.live import DecodeActivation
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.live import EldrLivePolicy, LiveDetail
from eldr_cli.synth import synthetic_trace
from eldr_cli.testing.stub_worker import fake_counts

L, E = 4, 16


def _model(protos: np.ndarray, act: np.ndarray, K: int = 4) -> RoutingModel:
    d = protos.shape[1]
    cent = np.eye(K, d)
    return RoutingModel("count", np.ones((L, E)), np.arange(L), cent, live=(protos, act))


def _disjoint(M: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Prototype m decodes on experts [4m, 4m+4) of every layer (each picked with p=0.5: top-2)."""
    protos = np.zeros((M, L * E))
    act = np.zeros((M + 1, L, E), dtype=np.float32)
    for m in range(M):
        protos[m, m] = 1.0
        act[m, :, 4 * m:4 * m + 4] = 0.5
    act[M] = act[:M].mean(axis=0)
    return protos, act


def _sig(m: int) -> np.ndarray:
    s = np.zeros(L * E)
    s[m] = 1.0
    return s


def test_decode_activation_rows_are_per_step_probabilities():
    tr = synthetic_trace(n_requests=200, num_layers=L, num_experts=E, top_k=2, decode_steps=16, seed=3)
    S = np.asarray(tr.prefill_counts, dtype=float).reshape(200, -1)
    S /= np.linalg.norm(S, axis=1, keepdims=True)
    est = DecodeActivation(n_prototypes=8, seed=0).fit(S, tr.decode_counts, tr.decode_steps)
    assert est.prototypes_.shape == (8, L * E) and est.activation_.shape == (9, L, E)
    np.testing.assert_allclose(np.linalg.norm(est.prototypes_, axis=1), 1.0, rtol=1e-9)
    # a_m(l, e) = mean over the prototype's members of decode_counts / decode_steps (row M: all rows)
    p = np.asarray(tr.decode_counts, dtype=float) / np.asarray(tr.decode_steps, dtype=float)[:, None, None]
    for m in range(8):
        np.testing.assert_allclose(est.activation_[m], np.clip(p[est.labels_ == m].mean(0), 0, 0.999), rtol=1e-6)
    np.testing.assert_allclose(est.activation_[8], np.clip(p.mean(0), 0, 0.999), rtol=1e-6)
    # predict is the nearest prototype (the largest cosine), checked by brute force on every calibration row
    for i in range(len(S)):
        cos = [float(S[i] @ est.prototypes_[m]) / float(np.linalg.norm(est.prototypes_[m])) for m in range(8)]
        assert cos[est.predict(S[i])] == pytest.approx(max(cos), abs=1e-12)
        assert est.predict(3.0 * S[i]) == est.predict(S[i])  # a direction: the scale of the counts does not matter
    assert [est.predict(p) for p in est.prototypes_] == list(range(8))
    # the fit's own labels are the nearest prototypes of their rows (k-means converged), all 200 rows kept
    assert len(est.labels_) == 200 and np.mean([est.predict(S[i]) == est.labels_[i] for i in range(200)]) > 0.95


def test_idle_decoder_wins_at_low_load_and_shared_experts_under_load():
    protos, act = _disjoint()
    r = make_router("eldr-live", 4, model=_model(protos, act))
    pol = r.policy
    assert isinstance(pol, EldrLivePolicy)
    # low load: decoder 0 runs one request of prototype 0; a second one of the same prototype goes elsewhere
    pol.on_dispatch(0, "a", pol.rank([0, 0, 0, 0], _sig(0)).detail)
    d = r.decide(None, [1, 0, 0, 0])
    assert d.worker != 0 and d.predicted_ms is not None and len(d.predicted_ms) == 4
    assert pol.rank([1, 0, 0, 0], _sig(0)).first != 0
    r.on_finish(0, "a")
    assert pol.is_empty()
    # under load: decoder k runs 6 requests of prototype k; a request of prototype 2 joins decoder 2
    for k in range(4):
        for i in range(6):
            pol.on_dispatch(k, f"{k}-{i}", LiveDetail(pol.live.source.entries[k], 0))
    ranking = pol.rank([6, 6, 6, 6], _sig(2))
    assert ranking.first == 2 and int(np.argmin(ranking.predicted_ms)) == 2
    # the load cap: decoder 2 far above the least loaded is not a candidate
    assert pol.rank([6, 6, 20, 6], _sig(2)).first != 2
    for k in range(4):
        for i in range(6):
            pol.on_finish(k, f"{k}-{i}")
    assert pol.is_empty()


def test_replicas_vectors_sum_to_a_single_router():
    protos, act = _disjoint()
    one, a, b = (make_router("eldr-live", 4, model=_model(protos, act)).policy for _ in range(3))
    rng = np.random.default_rng(0)
    for i in range(40):
        w, m = int(rng.integers(4)), int(rng.integers(4))
        detail = one.rank([0] * 4, _sig(m), tokens=10 + i).detail
        one.on_dispatch(w, i, detail)
        (a if i % 2 else b).on_dispatch(w, i, detail)
    for w in range(4):
        a.merge_state(w, b.export_state(w))
        b.merge_state(w, a.export_state(w))
    for rep in (a, b):
        np.testing.assert_allclose(rep.idle_probabilities(), one.idle_probabilities(), rtol=1e-5)
        assert (rep.live.tokens + rep.live.remote_tokens == one.live.tokens).all()
        for m in range(4):
            assert rep.rank([5, 3, 4, 6], _sig(m), tokens=7).first == one.rank([5, 3, 4, 6], _sig(m), tokens=7).first
    # the other replica's requests end: its vectors go back to zero and so does every q
    for i in range(0, 40, 2):
        b.on_finish(int(one.live.where[i][0]), i)
    for w in range(4):
        a.merge_state(w, b.export_state(w))
    for i in range(1, 40, 2):
        a.on_finish(int(one.live.where[i][0]), i)
    for w in range(4):
        b.merge_state(w, a.export_state(w))
    assert a.is_empty() and b.is_empty()


def test_preference_order_for_the_replicas_reservation():
    """The choice first, then the decoders within the load cap by predicted cost, then the rest by cost."""
    from eldr_cli.routing.policies import Ranking

    ranking = Ranking(0, slack=2, predicted_ms=np.array([3.0, 1.0, 0.5, 2.0, 0.1]))
    assert ranking.preference(2, [0, 1, 2, 3, 9]) == [2, 1, 0, 4, 3]  # cap 0 + 2: 3 and 4 are over
    assert ranking.preference(4, [0, 1, 2, 3, 9]) == [4, 2, 1, 0, 3]


def test_growth_is_the_cost_of_one_more_request_the_loads_left_out():
    """The replicas' reservation corrects each predicted cost by ``growth_ms`` per request in flight that the
    decision's loads did not count: exactly what the cost becomes with one more in B (same live set), idle
    decoders included; and the router's Offer carries costs and growth in the rule's tie order."""
    from eldr_cli.routing.router import Offer

    protos, act = _disjoint()
    r = make_router("eldr-live", 4, model=_model(protos, act))
    pol = r.policy
    for i, (w, m) in enumerate([(0, 0), (0, 0), (1, 1), (1, 0), (1, 2), (3, 3)]):
        pol.on_dispatch(w, i, pol.rank([0] * 4, _sig(m)).detail)
    loads = [2, 3, 0, 1]
    for m in range(4):
        base = pol.rank(loads, _sig(m), tokens=5)
        assert (base.growth_ms > 0).all()
        for d in range(4):
            more = pol.rank([x + (k == d) for k, x in enumerate(loads)], _sig(m), tokens=5)
            assert more.predicted_ms[d] - base.predicted_ms[d] == pytest.approx(base.growth_ms[d], rel=1e-5)
    dec = r.decide(None, loads)
    offer = r.reservation(dec, loads)
    # the order is the rule's tie order (policies.rerank): the decoder sent a request longest ago first
    assert isinstance(offer, Offer) and offer.order == list(dec.ranking.candidates)
    assert sorted(offer.order) == [0, 1, 2, 3]
    assert offer.cost == [float(dec.predicted_ms[k]) for k in offer.order]
    assert offer.growth == [float(dec.ranking.growth_ms[k]) for k in offer.order]
    assert offer.slack == dec.ranking.slack
    assert r.reservation(make_router("jsq", 4).decide(None, loads), loads).cost is None  # the first-in-order rule


def test_live_set_stays_exact_over_a_long_run_and_a_recount():
    """log q is float32 and updated by adding and subtracting: after many arrivals and departures (more than
    RECOUNT_EVERY on a decoder) q still equals its value computed afresh from the counts."""
    from eldr_cli.routing.live_set import RECOUNT_EVERY

    rng = np.random.default_rng(1)
    M1, K = 5, 2
    act = rng.uniform(0, 0.9, size=(M1, L, E)).astype(np.float32)
    pol = make_router("eldr-live", K, model=_model(rng.random((M1 - 1, L * E)), act)).policy
    live: list = []
    for i in range(2 * RECOUNT_EVERY + 3000):  # > RECOUNT_EVERY changes on each decoder
        if len(live) < 24 or rng.random() < 0.5:
            w = int(rng.integers(K))
            detail = pol.rank([0] * K, None, tokens=3).detail
            pol.on_dispatch(w, i, detail._replace(entry=pol.live.source.entries[int(rng.integers(M1))]))
            live.append((w, i))
        else:
            w, k = live.pop(int(rng.integers(len(live))))
            pol.on_finish(w, k)
    exact = np.exp(np.maximum(pol.live.counts @ np.log1p(-act.reshape(M1, -1).astype(np.float64)), -60.0))
    np.testing.assert_allclose(pol.idle_probabilities(), exact, rtol=2e-4)
    np.testing.assert_allclose(pol.live.view()[1], (1 - exact).sum(axis=1), rtol=1e-4)
    for w, k in live:
        pol.on_finish(w, k)
    assert pol.is_empty() and (pol.idle_probabilities() == 1).all() and not pol.live.view()[1].any()


def test_the_exact_recount_is_observed():
    """Float32 updates of log q drift from the exact sum; after RECOUNT_EVERY changes of a decoder the next
    refresh recounts it from the integer counts (local + remote): log q is then the float64 sum, rounded once."""
    from eldr_cli.routing.live import LiveDetail
    from eldr_cli.routing.live_set import RECOUNT_EVERY

    rng = np.random.default_rng(2)
    M1 = 5
    act = rng.uniform(0, 0.9, size=(M1, L, E)).astype(np.float32)
    pol = make_router("eldr-live", 1, model=_model(rng.random((M1 - 1, L * E)), act, K=1)).policy
    # log(1 - a) as the policy stores it (float32), summed in float64
    log_idle = np.log1p(-act.reshape(M1, -1).astype(np.float64)).astype(np.float32).astype(np.float64)
    pol.merge_state(0, [2, 0, 1, 0, 0, 0])  # another replica's requests count in the recount too
    live: list = []
    for i in range(RECOUNT_EVERY - 2):  # changes without a refresh in between: the float32 sum drifts
        if len(live) < 12 or (rng.random() < 0.5 and len(live) < 40):
            pol.on_dispatch(0, i, LiveDetail(pol.live.source.entries[int(rng.integers(M1))], 1))
            live.append(i)
        else:
            pol.on_finish(0, live.pop(int(rng.integers(len(live)))))
    assert pol.live._changes[0] == RECOUNT_EVERY - 1  # the remote vector's change counts as one
    exact = ((pol.live.counts[0] + pol.live.remote[0]) @ log_idle).astype(np.float32)
    pol.idle_probabilities()
    assert np.abs(pol.live.log_q[0] - exact).max() > 0  # drifted: the check below is not vacuous
    pol.on_dispatch(0, "last", LiveDetail(pol.live.source.entries[3], 1))  # the RECOUNT_EVERY-th change
    exact = ((pol.live.counts[0] + pol.live.remote[0]) @ log_idle).astype(np.float32)
    pol.idle_probabilities()
    np.testing.assert_array_equal(pol.live.log_q[0], exact)  # recounted: exact, bit for bit
    assert pol.live._changes[0] == 0


def test_artifact_without_the_live_model_is_refused_by_name():
    m = RoutingModel("count", np.ones((L, E)), np.arange(L), np.eye(4, L * E))
    with pytest.raises(EldrError, match="eldr fit"):
        make_router("eldr-live", 4, model=m)
    assert make_router("eldr", 4, model=m).name == "eldr"  # the other policies still serve


def test_simulator_live_set_is_empty_after_every_request(tmp_path, monkeypatch):
    import eldr_cli.simulator.cluster as simc
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.costmodel import CostModel, write_cost_model
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.simulate import run_simulate

    t = synthetic_trace(160, L, E, 2, decode_steps=8, with_picks=True, seed=1)
    write_trace(tmp_path / "trace", t)
    run_fit(tmp_path / "trace", tmp_path / "fit", decoders=3, figures=False, pairs=2000)
    write_cost_model(tmp_path / "cost", CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, source="given"))
    built = []
    real = simc.make_router
    # a spy on the lifecycle while the run goes on: at every decision the live set on each decoder holds exactly
    # the decode engine's in-flight requests (the loads the router is given), so dispatches and finishes happen
    # when they should, not only in the final drain
    seen = {"decide": 0, "dispatch": [], "finish": [], "mismatch": [], "busy": 0}

    class Spy:  # the simulator's router, every call counted (DecodeRouter has __slots__: wrap, don't patch)
        def __init__(self, r):
            self.r = r

        def __getattr__(self, name):
            return getattr(self.r, name)

        def decide(self, counts, loads, **k):
            live = self.r.live_set.counts.sum(axis=1).tolist()
            if live != list(loads):
                seen["mismatch"].append((live, list(loads)))
            seen["decide"] += 1
            seen["busy"] = max(seen["busy"], sum(live))
            return self.r.decide(counts, loads, **k)

        def on_dispatch(self, d, key):
            seen["dispatch"].append(key)
            return self.r.on_dispatch(d, key)

        def on_finish(self, w, key):
            assert key in seen["dispatch"] and key not in seen["finish"]  # once, after its dispatch
            seen["finish"].append(key)
            return self.r.on_finish(w, key)

    def keep(*a, **kw):
        built.append(real(*a, **kw))
        return Spy(built[-1])

    monkeypatch.setattr(simc, "make_router", keep)
    run_simulate(tmp_path / "sim", trace=tmp_path / "trace", cost_model=tmp_path / "cost",
                     routing=tmp_path / "fit", split="all", routers=["eldr-live"], rates=[40.0], n_prefill=1,
                     n_decode=3, duration_s=4, warmup_s=1, max_tokens=8, workers=1)
    (router,) = built
    assert router.stateful and router.policy.is_empty()
    n = seen["decide"]
    assert n > 100 and len(seen["dispatch"]) == n and len(set(seen["dispatch"])) == n
    assert sorted(seen["finish"]) == sorted(seen["dispatch"])  # every request finished exactly once
    assert not seen["mismatch"], seen["mismatch"][:3]
    assert seen["busy"] > 0  # requests were in flight when others arrived (the check above was not vacuous)


# -- the proxy -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def routing3(tmp_path_factory):
    return build_routing(tmp_path_factory.mktemp("live3"), decoders=3)


def _open_stream(stack, client, url, prompt, max_tokens=400):
    r = stack.enter_context(client.stream("POST", url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}))
    assert r.status_code == 200
    lines = r.iter_lines()  # kept with the response: a dropped generator would close the stream
    next(lines)  # the decode leg has started: the request is dispatched
    stack.callback(lines.close)
    return r


def test_proxy_live_set_empties_after_success_error_and_cancel(routing3, tmp_path):
    c = Cluster(routing=str(routing3), policy="eldr-live", decision_log=str(tmp_path / "d.jsonl"),
                stub_kw={"token_delay_s": 0.02})
    try:
        pol = c.app.state.router.policy
        bodies = [{"prompt": "fine one", "max_tokens": 3}, {"prompt": "[[fault:decode_500]] x", "max_tokens": 3},
                  {"prompt": "[[fault:decode_drop]] y", "max_tokens": 6, "stream": True},
                  {"prompt": "[[fault:prefill_nosig]] z", "max_tokens": 3}]
        for b in bodies:
            httpx.post(c.url + "/v1/completions", json={"model": "m", **b}, timeout=30)
        with httpx.Client(timeout=30) as client, contextlib.ExitStack() as stack:
            for i in range(3):
                _open_stream(stack, client, c.url, f"held open {i}")
            assert sum(pol.live.counts.sum(axis=1)) == 3  # three live requests while their streams are open
        assert c.settle(30) == 0
        assert pol.is_empty()
    finally:
        c.close()
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]  # flushed at close
    assert len(rows) == 7 and all(len(r["predicted_ms"]) == 3 and r["policy"] == "eldr-live" for r in rows)


def test_proxy_and_simulator_router_decide_alike_on_the_same_events(routing3):
    """The proxy's decisions on a sequence of arrivals and departures equal those of a router built by the
    same factory (as the simulator builds it) fed the same events: one decision object, no copies."""
    events = ["+0", "+1", "+2", "+3", "-1", "+4", "+5", "-0", "-3", "+6", "+7", "+8", "-5", "+9"]
    prompts = {i: f"request {i} about topic {i * 13} and more words {'w ' * i}" for i in range(10)}
    c = Cluster(routing=str(routing3), policy="eldr-live", stub_kw={"token_delay_s": 0.05})
    chosen_proxy: dict[int, int] = {}
    try:
        with httpx.Client(timeout=60) as client, contextlib.ExitStack() as top:
            open_: dict[int, contextlib.ExitStack] = {}
            for ev in events:
                i = int(ev[1:])
                if ev[0] == "+":
                    s = top.enter_context(contextlib.ExitStack())
                    r = _open_stream(s, client, c.url, prompts[i])
                    chosen_proxy[i] = int(r.headers["x-eldr-decode-worker"][1:])
                    open_[i] = s
                else:
                    n = c.app.state.in_progress
                    open_.pop(i).close()
                    _wait(lambda n=n: c.app.state.in_progress == n - 1)
    finally:
        c.close()
    model = RoutingModel.load(routing3)
    ref = make_router("eldr-live", 3, model=model)
    loads = [0, 0, 0]
    where: dict[int, int] = {}
    for ev in events:
        i = int(ev[1:])
        if ev[0] == "+":
            d = ref.decide(fake_counts(prompts[i]), loads, tokens=len(prompts[i].split()) + 400 // 2)
            ref.on_dispatch(d, i)
            where[i] = d.worker
            loads[d.worker] += 1
        else:
            ref.on_finish(where[i], i)
            loads[where[i]] -= 1
    assert where == chosen_proxy
    assert len(set(where.values())) > 1


def _wait(cond, timeout=30.0):
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "the proxy did not see the client close"
        time.sleep(0.01)


def test_proxy_refuses_a_cost_model_of_another_model(routing3, tmp_path):
    from eldr_cli.costmodel.roofline import run_cost_model
    from eldr_cli.proxy import build_config, create_app

    run_cost_model(tmp_path / "cost", "Qwen3-30B-A3B", device="H100-SXM")
    cfg = build_config(None, routing=str(routing3), policy="eldr-live", cost_model=str(tmp_path / "cost"),
                       prefill=["http://127.0.0.1:9"], decode=[f"http://127.0.0.1:{p}" for p in (10, 11, 12)])
    with pytest.raises(EldrError, match=r"Qwen3-30B-A3B \(L=48, E=128\).*L=4, E=16"):
        create_app(cfg)
    # a decode step measured on a GPU describes one model too
    from eldr_cli.costmodel.measured_step import run_decode_step_from_measured

    run_decode_step_from_measured(tmp_path / "step", device="H100-SXM")
    cfg = build_config(None, routing=str(routing3), policy="eldr-live", cost_model=str(tmp_path / "step"),
                       prefill=["http://127.0.0.1:9"], decode=[f"http://127.0.0.1:{p}" for p in (10, 11, 12)])
    with pytest.raises(EldrError, match=r"measured decode step of Qwen3-30B-A3B \(L=48, E=128\).*L=4, E=16"):
        create_app(cfg)


def test_the_compiled_cost_loop_is_the_step_formula_on_python_floats_bit_for_bit():
    """eldr-live's per-decoder cost and growth (routing.compiled.live_costs) equal, bit for bit, the rule written on
    Python floats through costmodel.step_ms_from_terms, with and without the roof, idle decoders included."""
    import numpy as np

    from eldr_cli.costmodel import StepTerms, step_ms_from_terms
    from eldr_cli.routing.compiled import live_costs
    from eldr_cli.routing.live import step_form

    rng = np.random.default_rng(4)
    for terms in (step_form(None, 48), StepTerms(*rng.random(8))._replace(roof=1.0),
                  StepTerms(*rng.random(8))._replace(roof=0.0)):
        for _ in range(500):
            K = int(rng.integers(1, 20))
            ld = rng.integers(0, 5, size=K)
            active, ctx, added = rng.random(K) * 3000, rng.random(K) * 1e5 * (rng.random(K) < 0.8), rng.random(K) * 40
            c_new = int(rng.integers(0, 5000))
            cost, growth = np.empty(K), np.empty(K)
            live_costs(np.asarray(terms, dtype=np.float64), ld, active, ctx, added, c_new, cost, growth)
            want_cost, want_growth = [], []
            for b, a, c, d in zip(ld.tolist(), active.tolist(), ctx.tolist(), added.tolist(), strict=True):
                B = float(b)
                tb = step_ms_from_terms(terms, a, B, c)
                t1 = step_ms_from_terms(terms, a + d, B + 1, c + c_new)
                want_cost.append(t1 + B * (t1 - (tb if B > 0 else 0.0)))
                want_growth.append(t1 - tb + terms.kt)
            assert cost.tobytes() == np.array(want_cost).tobytes()
            assert growth.tobytes() == np.array(want_growth).tobytes()
