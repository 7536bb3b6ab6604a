"""The offline fit's method: IDF, rho, greedy layers, exact balanced assignment, band routing."""

import math

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment
from scipy.stats import spearmanr

from eldr_cli.method.cluster import BalancedKMeans, assignment_cost, balanced_assignment
from eldr_cli.method.idf import ExpertIDF
from eldr_cli.method.layers import LayerSelector
from eldr_cli.method.signature import (
    _rank,
    decode_pattern,
    pair_cosine_distance,
    sample_pairs,
    signature_quality,
    signatures,
    spearman_to_target,
)
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.policies import locality_band, split_workers_by_share
from eldr_cli.synth import synthetic_trace


def test_idf_hand_computed():
    # 3 requests, 1 layer, 3 experts; expert 0 fires in all, expert 1 in one, expert 2 never
    c = np.array([[[5, 0, 0]], [[1, 2, 0]], [[3, 0, 0]]])
    est = ExpertIDF().fit(c)
    assert est.n_requests_ == 3
    assert est.df_.tolist() == [[3, 1, 0]]
    np.testing.assert_allclose(est.idf_, [[math.log(4 / 4), math.log(4 / 2), math.log(4 / 1)]])
    np.testing.assert_allclose(est.transform(c)[1], [[0.0, 2 * math.log(2), 0.0]])


def test_rho_equals_scipy_spearman_on_same_pairs():
    t = synthetic_trace(200, 6, 16, 2, seed=3)
    pairs = sample_pairs(200, 3000, seed=1)
    s = signatures(t.prefill_counts, "count", None, np.arange(6))
    p = decode_pattern(t.decode_counts, t.decode_steps)
    ds = np.array([1 - s[i] @ s[j] for i, j in pairs])
    dp = np.array([1 - p[i] @ p[j] for i, j in pairs])
    np.testing.assert_allclose(pair_cosine_distance(s, pairs), ds, atol=1e-12)
    np.testing.assert_allclose(pair_cosine_distance(p, pairs), dp, atol=1e-12)
    expected = spearmanr(pair_cosine_distance(s, pairs), pair_cosine_distance(p, pairs)).statistic
    assert signature_quality(s, p, pairs) == expected
    assert expected == pytest.approx(spearmanr(ds, dp).statistic, abs=1e-6)
    # the fast batched ranking used by the greedy search agrees too
    tr = _rank(dp)
    tr -= tr.mean()
    assert spearman_to_target(ds[None], tr)[0] == pytest.approx(expected, abs=1e-6)


def test_fast_spearman_handles_ties_like_scipy():
    rng = np.random.default_rng(0)
    d = rng.integers(0, 7, size=(5, 400)).astype(np.float64) / 4  # many exact ties, float32-exact
    target = rng.random(400)
    tr = _rank(target)
    tr -= tr.mean()
    got = spearman_to_target(d, tr)
    for row, g in zip(d, got, strict=True):
        assert g == pytest.approx(spearmanr(row, target).statistic, abs=1e-9)


def test_pairs_are_distinct_and_fixed_by_seed():
    a = sample_pairs(50, 5000, seed=7)
    assert (a[:, 0] != a[:, 1]).all() and a.min() >= 0 and a.max() < 50
    np.testing.assert_array_equal(a, sample_pairs(50, 5000, seed=7))


def test_greedy_picks_informative_layers_first():
    informative = [1, 4, 6]
    # request-specific routing shared by prefill and decode only at the informative layers
    t = synthetic_trace(400, 10, 32, 4, informative_layers=informative, request_noise=0.7, seed=5,
                        with_gates=False)
    idf = ExpertIDF().fit(t.prefill_counts).idf_
    sel = LayerSelector(transform="count", n_pairs=5000, seed=0).fit(
        t.prefill_counts, t.decode_counts, t.decode_steps, idf)
    assert set(sel.order_[:3].tolist()) == set(informative)
    assert sorted(sel.order_.tolist()) == list(range(10))  # all layers ordered
    assert sel.n_layers_ == 3 and sel.cumulative_rho_[2] == sel.cumulative_rho_.max()
    assert sel.cumulative_rho_[2] > sel.cumulative_rho_[-1] + 0.05  # noise layers dilute the signature
    assert set(sel.mask_.tolist()) == set(sel.order_[: sel.n_layers_].tolist())


def test_auto_transform_scores_all_and_keeps_best_servable():
    t = synthetic_trace(300, 6, 16, 2, seed=2)
    idf = ExpertIDF().fit(t.prefill_counts).idf_
    sel = LayerSelector(n_pairs=3000).fit(t.prefill_counts, t.decode_counts, t.decode_steps, idf,
                                          {"gate-prob": t.prefill_gate_prob, "gate-logit": t.prefill_gate_logit})
    assert set(sel.rho_by_transform_) == {"count", "count-idf", "sqrt", "binary", "gate-prob", "gate-logit"}
    servable = {k: v for k, v in sel.rho_by_transform_.items() if not k.startswith("gate")}
    assert sel.transform_ == max(servable, key=servable.get)


def _hungarian_optimum(cost, capacity):
    big = np.repeat(cost, capacity, axis=1)  # each centroid column repeated capacity times
    r, c = linear_sum_assignment(big)
    return big[r, c].sum()


@pytest.mark.parametrize("n,k", [(7, 3), (50, 4), (201, 16), (600, 7), (2000, 16)])
def test_balanced_assignment_matches_hungarian_oracle(n, k):
    rng = np.random.default_rng(n * 31 + k)
    X = rng.normal(size=(n, 12))
    X[: n // 2] += 3 * rng.normal(size=12)  # a dense region that wants one centroid
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    C = X[rng.choice(n, size=k, replace=False)]
    cost = 1 - X @ C.T
    cap = math.ceil(n / k)
    labels = balanced_assignment(cost, cap)
    assert np.bincount(labels, minlength=k).max() <= cap
    assert assignment_cost(cost, labels) == pytest.approx(_hungarian_optimum(cost, cap), abs=1e-6)


def test_pruned_assignment_is_certified_against_full_matrix():
    # with m=1 the first solve sees only each point's nearest centroid; capacities force repair
    rng = np.random.default_rng(0)
    cost = rng.random((300, 10))
    cost[:, 0] -= 1.0  # everyone prefers centroid 0
    labels = balanced_assignment(cost, 30, m=1)
    assert np.bincount(labels, minlength=10).max() <= 30
    assert assignment_cost(cost, labels) == pytest.approx(_hungarian_optimum(cost, 30), abs=1e-6)


def _skewed(n=1200, d=16, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, d)) * 3
    sizes = [700, 300, 150, 50]
    X = np.concatenate([centers[i] + 0.3 * rng.normal(size=(s, d)) for i, s in enumerate(sizes)])
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def test_vanilla_kmeans_unbalanced_balanced_equal():
    X = _skewed()
    van = BalancedKMeans(4, balanced=False, seed=0).fit(X)
    bal = BalancedKMeans(4, balanced=True, seed=0).fit(X)
    cap = math.ceil(len(X) / 4)
    assert van.sizes_.max() > cap and van.sizes_.min() < len(X) / 4  # skewed data, unequal clusters
    assert bal.sizes_.max() <= math.ceil(len(X) / 4)
    assert bal.sizes_.sum() == len(X)
    np.testing.assert_allclose(np.linalg.norm(bal.centroids_, axis=1), 1.0)


def test_kmeans_is_deterministic_per_seed():
    X = _skewed(400)
    a = BalancedKMeans(5, seed=3).fit(X)
    b = BalancedKMeans(5, seed=3).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.centroids_, b.centroids_)


def test_band_tau0_is_top1_and_tau1_is_jsq():
    rng = np.random.default_rng(1)
    C = rng.random((8, 20))
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    for _ in range(200):
        s = rng.random(20)
        s /= np.linalg.norm(s)
        loads = rng.integers(0, 10, size=8)
        assert locality_band(s, C, loads, 0.0).worker == int(np.argmax(C @ s))
        d1 = locality_band(s, C, loads, 1.0)
        assert loads[d1.worker] == loads.min() and len(d1.band) == 8


def test_band_prefers_least_loaded_within_band():
    C = np.eye(3)
    s = np.array([0.8, 0.6, 0.0])  # cos 0.8, 0.6, 0
    d = locality_band(s, C, [5, 1, 0], tau=0.25)
    assert d.band.tolist() == [0, 1] and d.worker == 1
    assert locality_band(s, C, [5, 1, 0], tau=0.1).worker == 0


def test_routing_model_signature_matches_batch_signatures():
    t = synthetic_trace(50, 6, 16, 2, seed=4)
    idf = ExpertIDF().fit(t.prefill_counts).idf_
    mask = np.array([1, 3, 4])
    S = signatures(t.prefill_counts, "count-idf", idf, mask)
    C = S[:4] + 0.0
    m = RoutingModel("count-idf", idf, mask, C, tau=0.1)
    for r in range(10):
        np.testing.assert_allclose(m.signature(t.prefill_counts[r]), S[r], atol=1e-12)


def _pick(router, loads, **kw) -> int:
    return router.decide(None, loads, **kw).worker


def test_baseline_policies():
    loads = [3, 0, 2, 0]
    rr = make_router("round-robin", 4)
    assert [_pick(rr, loads) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert _pick(make_router("jsq", 4), loads) == 1
    p2c = make_router("p2c", 4, seed=0)
    for _ in range(50):
        assert _pick(p2c, [0, 9, 9, 9]) in range(4)
    picks = {_pick(make_router("random", 4, seed=s), loads) for s in range(30)}
    assert picks == {0, 1, 2, 3}
    dom = make_router("domain", 4, domain_share={"a": 0.75, "b": 0.25})
    assert split_workers_by_share({"a": 0.75, "b": 0.25}, 4) == {"a": [0, 1, 2], "b": [3]}
    assert _pick(dom, [5, 1, 3, 0], domain="a") == 1
    assert _pick(dom, [5, 1, 3, 0], domain="b") == 3
    assert _pick(dom, [5, 1, 3, 0], domain=None) == 3 and dom.facts() == {"unlabelled_domain": 1}


def test_p2c_takes_less_loaded_of_two():
    p = make_router("p2c", 2, seed=0)
    assert all(_pick(p, [4, 1]) == 1 for _ in range(20))


def test_decide_falls_back_to_the_least_loaded_healthy_worker():
    """The "chosen decoder is down" fallback lives in the decode router (proxy, simulator, replay)."""
    rr = make_router("round-robin", 3)
    assert _pick(rr, [0, 5, 1], healthy=[False, True, True]) == 2  # its pick (0) is down
    assert _pick(rr, [0, 5, 1], healthy=[True, True, True]) == 1  # healthy pick kept
    assert _pick(make_router("jsq", 3), [0, 5, 1]) == 0  # no health given: the policy's own pick


def test_router_signature_states_and_band():
    """decide() reports where the signature came from; eldr without counts is JSQ; a wrong shape is
    'malformed', never an exception; with counts the band decision is the locality band's."""
    rng = np.random.default_rng(0)
    L, E, K = 3, 8, 4
    C = rng.random((K, 2 * E))
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    m = RoutingModel("count", np.ones((L, E)), np.array([0, 2]), C, tau=0.05)
    r = make_router("eldr", K, model=m)
    assert r.needs_signature and r.tau == 0.05
    d = r.decide(None, [2, 0, 1, 3])
    assert (d.worker, d.signature, d.band) == (1, "missing", None)
    bad = r.decide(np.ones((L + 1, E)), [2, 0, 1, 3])
    assert (bad.worker, bad.signature) == (1, "malformed")
    counts = rng.integers(0, 5, size=(L, E))
    d = r.decide(counts, [0, 0, 0, 0], key=7)
    ref = locality_band(m.signature(counts), C, [0, 0, 0, 0], 0.05)
    assert d.signature == "ok" and d.worker == ref.worker and list(d.band) == list(ref.band)
    # a key names the request: its signature is computed once (offline callers replay rows many times)
    assert r.decide(np.zeros((L, E)), [0, 0, 0, 0], key=7).worker == d.worker
    assert make_router("jsq", K).decide(counts, [1, 0, 1, 1]).signature == "unused"


def test_gram_distances_do_not_depend_on_blas_threads():
    """The Gram matrix takes one BLAS thread per core; its distances must be the same bits for any
    thread count, or rho would depend on the machine."""
    from threadpoolctl import threadpool_limits

    from eldr_cli.method.signature import _pair_cosine_distance_f32, sample_pairs

    x = np.random.default_rng(0).poisson(3.0, size=(700, 12 * 64)).astype(np.float32)
    pairs = sample_pairs(len(x), 5000, seed=0)
    got = []
    for threads in (1, 2, 3):
        with threadpool_limits(threads, user_api="blas"):
            got.append((x @ x.T, _pair_cosine_distance_f32(x.copy(), pairs)))
    for g, d in got[1:]:
        np.testing.assert_array_equal(g, got[0][0])
        np.testing.assert_array_equal(d, got[0][1])
