"""Learned per-layer signature weights (issue 35, item 4): raise rho where a layer is under-weighted, never lower it."""

import numpy as np
import pytest

from eldr_cli.method.layers import LayerSelector


def _trace(seed=0, R=400, L=3, E=16):
    """Requests of 8 topics; each layer's prefill follows the topic's decode pattern, but layer 0 sees 6 prompt
    tokens where the others see 40: under the count transform its block is short, so plain cosine under-weights
    the layer, and layer 2's prefill is 70% noise."""
    rng = np.random.default_rng(seed)
    topic = rng.integers(0, 8, size=R)
    base = rng.dirichlet(np.full(E, 0.2), size=(8, L))
    dec = np.stack([np.stack([rng.multinomial(64, base[topic[r], l]) for l in range(L)]) for r in range(R)])
    pre = np.stack([np.stack([
        rng.multinomial(6, base[topic[r], 0]) if l == 0 else
        rng.multinomial(40, base[topic[r], 1]) if l == 1 else
        rng.multinomial(40, 0.3 * base[topic[r], 2] + 0.7 * rng.dirichlet(np.ones(E))) for l in range(L)])
        for r in range(R)])
    return pre, dec, np.full(R, 64), np.ones((L, E))


def test_learned_weights_raise_rho_on_the_half_they_were_not_fitted_on():
    pre, dec, steps, idf = _trace()
    sel = LayerSelector(transform="count", n_pairs=20000, seed=0).fit(pre, dec, steps, idf)
    plain = LayerSelector(transform="count", n_pairs=20000, seed=0, learn_weights=False).fit(pre, dec, steps, idf)
    r = sel.weight_rho_
    assert r["rho_learned_check_half"] > r["rho_plain_check_half"] + 0.005
    assert sel.layer_weights_[0] > 1  # the short layer is weighted up
    np.testing.assert_array_equal(sel.mask_, plain.mask_)
    np.testing.assert_allclose(sel.weights_, plain.weights_ * sel.layer_weights_[:, None])
    assert (plain.layer_weights_ == 1).all() and plain.weight_rho_ == {}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_learned_weights_never_lower_rho_on_the_check_half(seed):
    rng = np.random.default_rng(seed)
    R, L, E = 200, 4, 8
    pre = rng.integers(0, 5, size=(R, L, E))
    dec = rng.integers(0, 5, size=(R, L, E))  # unrelated: nothing to learn
    sel = LayerSelector(transform="count", n_pairs=5000, seed=0).fit(pre, dec, np.full(R, 16), np.ones((L, E)))
    r = sel.weight_rho_
    assert r["rho_learned_check_half"] >= r["rho_plain_check_half"]
