"""eldr-live's per-request decode-activation predictor (issue 35): fitted, chosen and measured inside fit, and
what it changes in the decision."""

import numpy as np
import pytest

from eldr_cli.method.live import DecodeActivation
from eldr_cli.method.live_quality import choose, predictor_quality
from eldr_cli.method.shrinkage import prefill_frequency, shrink
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.live import LiveDetail


def _trace(R=240, L=3, E=16, k=2, follow=0.8, seed=0):
    """Requests from 4 topics; each request's decode follows its OWN prefill distribution (share ``follow``) more
    than its topic's mean: the prompt says more about the answer than the topic does."""
    rng = np.random.default_rng(seed)
    topics = rng.dirichlet(np.full(E, 0.3), size=(4, L))
    own = np.stack([rng.dirichlet(topics[r % 4, l] * 20 + 0.05) for r in range(R) for l in range(L)])
    own = own.reshape(R, L, E)
    tokens = rng.integers(20, 200, size=R)
    prefill = np.stack([np.stack([rng.multinomial(tokens[r] * k, own[r, l]) for l in range(L)]) for r in range(R)])
    steps = np.full(R, 64)
    p_dec = follow * own + (1 - follow) * topics[np.arange(R) % 4]
    decode = np.stack([np.stack([rng.binomial(steps[r], np.clip(p_dec[r, l] * k, 0, 1)) for l in range(L)])
                       for r in range(R)])
    sig = prefill.reshape(R, -1).astype(np.float64)
    sig /= np.linalg.norm(sig, axis=1, keepdims=True)
    return sig, decode, steps, prefill, k


def test_the_request_own_prefill_predicts_better_than_its_prototype_on_the_held_back_split():
    sig, decode, steps, prefill, k = _trace()
    est = DecodeActivation(n_prototypes=8, seed=0).fit(sig, decode, steps, prefill, k)
    q = est.quality_
    assert q is not None and est.predictor_ in ("shrinkage", "shrinkage-global")
    assert q["shrinkage"]["brier"] < 0.9 * q["prototype"]["brier"]
    assert q["shrinkage"]["log_loss"] < q["prototype"]["log_loss"]
    assert q["clairvoyant"]["brier"] == 0 and q["clairvoyant"]["union_err_pct_b8"] == 0
    assert (est.shrinkage_.weight > 0).all() and np.isfinite(est.shrinkage_.kappa).all()


def test_a_predictor_that_ignores_the_request_scores_worse_than_the_fitted_one():
    """The global mean (the same a for every request) is what a predictor that ignores the request returns: it must
    lose to the prototype and to the shrinkage on the held-back split, and the served predictions must differ by
    request."""
    sig, decode, steps, prefill, k = _trace(seed=1)
    est = DecodeActivation(n_prototypes=8, seed=0).fit(sig, decode, steps, prefill, k)
    y = np.clip(decode / steps[:, None, None], 0, 0.999)
    mean = np.broadcast_to(y.mean(axis=0), y.shape)
    brier_mean = float(((mean - y) ** 2).mean())
    assert est.quality_ is not None and est.quality_["shrinkage"]["brier"] < 0.8 * brier_mean
    f, tok = prefill_frequency(prefill[:2], k)
    a = shrink(f, tok, est.activation_[est.predict(sig[0])][None].repeat(2, 0), est.shrinkage_.kappa,
               est.shrinkage_.weight)
    assert np.abs(a[0] - a[1]).max() > 0.05


def test_choose_keeps_the_simplest_within_tolerance():
    q = {"prototype": {"brier": 1.0}, "shrinkage-global": {"brier": 0.999}, "shrinkage": {"brier": 0.5}}
    assert choose(q) == "shrinkage"
    q["shrinkage"]["brier"] = 0.998  # within 0.5% of the simpler global one: the global one is kept
    assert choose(q) == "prototype"
    assert choose(None) == "prototype"


def test_no_held_back_rows_no_measurement():
    sig, decode, steps, prefill, k = _trace(R=6)
    f, tok = prefill_frequency(prefill, k)
    y = np.clip(decode / 64, 0, 0.999)
    assert predictor_quality(sig, y, f, tok, np.zeros(6, dtype=int), 1) is not None
    assert predictor_quality(sig[:3], y[:3], f[:3], tok[:3], np.zeros(3, dtype=int), 1) is None


def _model(weight: float) -> RoutingModel:
    protos = np.array([[1.0, 0, 0, 0], [0, 0, 1.0, 0]])
    act = np.array([[[0.5, 0.5, 0, 0]], [[0, 0, 0.5, 0.5]], [[0.25, 0.25, 0.25, 0.25]]], dtype=np.float32)
    return RoutingModel("count", np.ones((1, 4)), np.arange(1), np.eye(2, 4), live=(protos, act),
                        live_shrinkage=(np.array([0.0]), np.array([weight])), top_k=1)


@pytest.mark.parametrize("weight, expected", [(1.0, 1), (0.0, 0)])
def test_the_shrinkage_weight_changes_the_decision(weight, expected):
    """Decoder 0 runs two requests of prototype 0 (experts 0, 1), decoder 1 two of prototype 1 (experts 2, 3). The
    new request's prompt is nearest prototype 0 (3 tokens on expert 0) but most of it (5 tokens) picked expert 3:
    by its own distribution it adds fewer experts to decoder 1; by its prototype's mean, to decoder 0."""
    router = make_router("eldr-live", 2, model=_model(weight))
    pol = router.policy
    for key, (w, m) in enumerate([(0, 0), (0, 0), (1, 1), (1, 1)]):
        pol.on_dispatch(w, key, LiveDetail(pol.live.source.entries[m], 0))
    d = router.decide(np.array([[3, 0, 0, 5]]), [2, 2])
    assert d.worker == expected
    assert d.detail.prototype == 0


def _random_model(rng, transform: str, L=6, E=24, M=5) -> RoutingModel:
    """A routing artifact with eldr-live's shrinkage on every layer but one (kappa inf there: the prototype alone)."""
    mask = np.array([0, 2, 3, 5])
    protos = rng.random((M, len(mask) * E))
    act = np.clip(rng.dirichlet(np.full(E, 0.3), size=(M + 1, L)) * 4, 0, 0.999).astype(np.float32)
    kappa = rng.choice([0.0, 2.0, 32.0, np.inf], size=L)
    kappa[1] = np.inf
    return RoutingModel(transform, rng.random((L, E)) + 0.1, mask, np.eye(2, len(mask) * E), live=(protos, act),
                        live_shrinkage=(kappa, rng.random(L)), top_k=3)


def _bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x).tobytes()


@pytest.mark.parametrize("transform", ["count", "count-idf", "sqrt", "binary"])
def test_the_compiled_request_path_is_bit_identical_to_its_numpy_form(transform):
    """Eq. 2 and the shrunk activation run as compiled loops (routing.compiled); on random counts of every integer
    width the proxy decodes (and int64, with empty layers and whole empty requests) each value is the numpy form's,
    bit for bit: the signature against method.signature.weighted_cells, the entry against PrefillPredictor's numpy
    shrinkage and its log."""
    from eldr_cli.method.signature import signatures, weighted_cells
    from eldr_cli.routing.live_set import LiveEntry, PrefillPredictor

    rng = np.random.default_rng(7)
    model = _random_model(rng, transform)
    src = PrefillPredictor(model)
    seen_protos = set()
    for i in range(300):
        dtype = (np.uint8, np.uint16, np.uint32, np.int64)[i % 4]
        top = (3, 255, 40_000, 2_000)[i % 4] if dtype != np.uint16 else 60_000
        c = (rng.integers(0, top, size=model.shape) * (rng.random(model.shape) < rng.random())).astype(dtype)
        if i % 17 == 0:
            c[rng.integers(0, model.shape[0])] = 0
        if i % 50 == 0:
            c[:] = 0
        want_cells = weighted_cells(c[model.mask], transform, model._kept_weights).reshape(-1)
        assert _bits(model.signature(c, unit=False)) == _bits(want_cells)
        assert _bits(model.signatures([c, c])) == _bits(signatures(np.stack([c, c]), transform, model.weights,
                                                                model.mask))
        got = src.entry(c)
        assert isinstance(got, LiveEntry)
        if not want_cells.any():
            assert got is src.mean()
            continue
        # the prototype BLAS's float32 product finds nearest, the cells as computed, the numpy shrinkage
        assert got.prototype == int((src.protos @ want_cells.astype(np.float32)).argmax())
        assert got.cells is not None and _bits(got.cells) == _bits(want_cells)
        a = src._shrunk(c, got.prototype)
        assert _bits(got.activation) == _bits(a) and _bits(got.log_idle) == _bits(np.log1p(-a))
        seen_protos.add(got.prototype)
    assert len(seen_protos) > 1


def test_the_compiled_nearest_prototype_is_blass_or_declines():
    """routing.compiled.nearest_certain answers only where BLAS's float32 product must give the same prototype: on
    random prototypes (non-negative and signed) and vectors it agrees with ``argmax(protos @ v)`` whenever it answers;
    on an exact tie, and on two prototypes a float32 rounding apart, it declines (-1), and eldr-live's entry then
    takes BLAS's answer (the first of the tied rows), as before."""
    from eldr_cli.routing.compiled import nearest_certain
    from eldr_cli.routing.live_set import PrefillPredictor

    rng = np.random.default_rng(11)
    answered = 0
    for i in range(400):
        signed = i % 2 == 1
        P = rng.random((int(rng.integers(2, 40)), int(rng.integers(1, 300)))).astype(np.float32)
        if signed:
            P -= np.float32(0.3)
        v = (rng.random(P.shape[1]) * (rng.random(P.shape[1]) < 0.7)).astype(np.float32)
        m = nearest_certain(P, v, signed)
        if m >= 0:
            answered += 1
            assert m == int((P @ v).argmax())
    assert answered > 300  # it answers almost always on random prototypes
    P = rng.random((4, 64)).astype(np.float32)
    v = rng.random(64).astype(np.float32)
    best = int((P @ v).argmax())
    tie = np.concatenate([P[:best], P[best:best + 1], P[best:]])  # the best row twice: an exact tie
    assert nearest_certain(tie, v, False) == -1
    close = tie.copy()
    close[best + 1] = np.nextafter(close[best + 1], np.float32(2))  # one ulp above on every element
    assert nearest_certain(close, v, False) == -1

    model = _random_model(rng, "count")
    src = PrefillPredictor(model)
    c = rng.integers(0, 9, size=model.shape).astype(np.uint8)
    cells32 = model.signature(c, unit=False).astype(np.float32)
    src.protos = src.protos.copy()
    src.protos[0] = src.protos[1] = cells32 * 4  # rows 0 and 1 tie, and are this request's nearest by far
    got = src.entry(c)
    assert got.prototype == 0 == int((src.protos @ cells32).argmax())
    assert _bits(got.activation) == _bits(src._shrunk(c, 0))


def test_counts_too_large_for_float32_keep_the_numpy_form():
    """A layer whose counts sum to 2**24 or more (where float32 sums round) declines the compiled loop: the entry is
    still the numpy form's."""
    from eldr_cli.routing.compiled import shrunk_activation
    from eldr_cli.routing.live_set import PrefillPredictor

    rng = np.random.default_rng(3)
    src_model = _random_model(rng, "count")
    src = PrefillPredictor(src_model)
    c = rng.integers(0, 50, size=src_model.shape).astype(np.int64)
    c[0, :3] = [1 << 23, 1 << 23, 12_345]
    out = np.empty(c.size, dtype=np.float32)
    assert not shrunk_activation(c, src.act[0], src._w, src._kappa, src._inv_k, src._a_max, out, out.copy())
    got = src.entry(c)
    a = src._shrunk(c, got.prototype)
    assert _bits(got.activation) == _bits(a) and _bits(got.log_idle) == _bits(np.log1p(-a))
