"""eldr-live's band prior (issue 35): under load a decoder's cost is ranked times 1 + a (max s - s_k) / tau.

Two decoders, one layer of four experts; decoder k's centroid is expert k's axis (the band's s_k is the request's
cosine to it). Prototype 0 decodes on experts {0, 1}, prototype 1 on {2, 3}. A request with prefill counts
(3, 1, 0, 0) has s = (3, 1) / sqrt(10) = (0.949, 0.316); with tau = 0.1 and a = 0.5 the prior is
(1, 1 + 0.5 * 0.632 / 0.1) = (1, 4.16). The weight is the fit's: 0.5 where its calibration requests sit inside
their own band (mean cosine to their centroid >= 1 - tau / 2), else 0.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np

from eldr_cli.costmodel import CostModel
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.clairvoyant import ClairvoyantPolicy
from eldr_cli.routing.live import BAND_PRIOR, EldrLivePolicy, LiveDetail, band_prior_weight
from eldr_cli.routing.live_set import PrefillPredictor

COST = CostModel(a_ms=1.0, b_ms=0.5, c_ms=0.1, source="given")
COUNTS = np.array([[3, 1, 0, 0]], dtype=np.int64)
PRIOR = np.array([1.0, 1.0 + 0.5 * (3 - 1) / math.sqrt(10) / 0.1])


def _model(tau: float = 0.1, band_prior: float = BAND_PRIOR) -> RoutingModel:
    protos = np.array([[1.0, 0, 0, 0], [0, 0, 1.0, 0]])
    act = np.array([[[0.5, 0.5, 0, 0]], [[0, 0, 0.5, 0.5]], [[0.25, 0.25, 0.25, 0.25]]], dtype=np.float32)
    return RoutingModel("count", np.ones((1, 4)), np.arange(1), np.eye(2, 4), tau=tau, live=(protos, act),
                        band_prior=band_prior)


def _loaded(pol: EldrLivePolicy, n: int = 5) -> EldrLivePolicy:
    """n requests of prototype 1 (experts 2, 3) on decoder 0 and n of prototype 0 (experts 0, 1) on decoder 1:
    the request's experts run on decoder 1, while its band is decoder 0's."""
    entries = PrefillPredictor(_model()).entries
    for key in range(2 * n):
        w = key // n
        pol.on_dispatch(w, key, LiveDetail(entries[1 - w], 0))
    return pol


def _policy(band_prior: float = BAND_PRIOR) -> EldrLivePolicy:
    pol = make_router("eldr-live", 2, model=_model(band_prior=band_prior), cost=COST).policy
    assert isinstance(pol, EldrLivePolicy)
    return pol


def test_under_load_the_prior_keeps_a_request_on_its_band_and_without_it_the_cost_decides():
    assert BAND_PRIOR == 0.5
    pol = _loaded(_policy())
    entry = pol.request(COUNTS)
    np.testing.assert_allclose(entry.prior, PRIOR, rtol=1e-9)  # computed once, with the request's cells
    r = pol.rank([5, 5], entry, tokens=0)
    np.testing.assert_allclose(r.prior, PRIOR, rtol=1e-9)
    # predicted: decoder 1 is cheaper (it runs the request's experts) but 4.16 x its cost is not
    assert r.predicted_ms[1] < r.predicted_ms[0] < r.predicted_ms[1] * PRIOR[1]
    assert r.first == 0
    off = _loaded(_policy(band_prior=0.0))  # a fit that set no prior: the least predicted cost wins
    e0 = off.request(COUNTS)
    assert e0.prior is None
    r0 = off.rank([5, 5], e0, tokens=0)
    assert r0.first == 1 and r0.prior is None
    np.testing.assert_allclose(r0.predicted_ms, r.predicted_ms)  # the prior moves the choice, not the prediction


def test_near_idle_there_is_no_prior_and_a_request_known_only_by_its_prototype_has_none():
    pol = _loaded(_policy(), 1)
    r = pol.rank([1, 1], pol.request(COUNTS), tokens=0)  # 2 in flight on 2 decoders: under LOW_LOAD_MEAN
    assert r.prior is None
    r = _loaded(_policy()).rank([5, 5], np.array([1.0, 0, 0, 0]))  # a bare vector: no Eq. 2 cells
    assert r.prior is None


def test_a_fit_for_another_decoder_count_gives_no_prior():
    pol = make_router("eldr-live", 3, model=_model(), cost=COST).policy
    for key in range(15):
        pol.on_dispatch(key % 3, key, LiveDetail(pol.live.source.entries[key % 2], 0))
    assert pol.rank([5, 5, 5], pol.request(COUNTS)).prior is None


def test_the_reservation_redoes_the_rule_with_the_prior():
    router = make_router("eldr-live", 2, model=_model(), cost=COST)
    _loaded(router.policy)
    d = router.decide(COUNTS, [5, 5], tokens=0)
    assert d.worker == 0
    offer = router.reservation(d, [5, 5])
    r = d.ranking
    by_worker = dict(zip(offer.order, offer.cost, strict=True))
    assert by_worker == {k: float(r.predicted_ms[k] * r.prior[k]) for k in range(2)}
    # the Python rule the Lua script is checked against: on the exact counts it keeps the band's decoder,
    # where the bare predicted costs would move the request to decoder 1
    assert r.rerank([5, 5]) == 0
    bare = dataclasses.replace(r, prior=None)
    assert bare.rerank([5, 5]) == 1


def test_the_clairvoyant_twin_has_no_prior_given_the_truth_there_is_nothing_to_hedge():
    truth = {0: np.array([0.5, 0.5, 0, 0], dtype=np.float32)}
    twin = make_router("clairvoyant", 2, model=_model(), cost=COST, oracle=SimpleNamespace(future=truth))
    assert isinstance(twin.policy, ClairvoyantPolicy)
    _loaded(twin.policy)
    d = twin.decide(COUNTS, [5, 5], key=0, tokens=0)
    assert d.ranking.prior is None and d.worker == 1  # its experts run on decoder 1


def test_the_fit_trusts_the_band_only_where_its_requests_sit_inside_it():
    assert band_prior_weight({"centroid": {"mean": 0.969}}, 0.1) == 0.5  # the demo's trace
    assert band_prior_weight({"centroid": {"mean": 0.915}}, 0.1) == 0.0  # GENERATED Qwen3 shape
    assert band_prior_weight({"centroid": {"mean": 0.915}}, 0.2) == 0.5  # a wider band
    assert band_prior_weight(None, 0.1) == 0.0 and band_prior_weight({}, 0.1) == 0.0


def test_a_fitted_artifact_carries_its_weight_and_one_fitted_before_it_has_none(tmp_path):
    import json

    from _proxy_util import build_routing

    routing = build_routing(tmp_path, decoders=3) / "routing"
    manifest = routing / "manifest.json"
    p = json.loads(manifest.read_text())["params"]
    assert p["band_prior"] == band_prior_weight(p["drift"], p["tau"])
    assert RoutingModel.load(routing).band_prior == p["band_prior"]
    m = json.loads(manifest.read_text())
    m["params"]["band_prior"] = 0.5
    manifest.write_text(json.dumps(m))
    assert RoutingModel.load(routing).band_prior == 0.5
    del m["params"]["band_prior"]
    manifest.write_text(json.dumps(m))
    assert RoutingModel.load(routing).band_prior == 0.0
