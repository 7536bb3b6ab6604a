"""The fit's outputs pinned to the values computed before the issue-15 speed work, on fixed generated traces.

Any optimisation of greedy layer selection, signatures or the fit command must leave these unchanged
(rho to 1e-6; the chosen order and transform exactly).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_cli.artifacts.trace import write_trace
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.stages.idf import ExpertIDF
from eldr_cli.stages.layers import LayerSelector
from eldr_cli.synth import synthetic_trace

# computed on main at c0d963b (before issue 15's changes)
ORDER = [4, 8, 10, 0, 2, 6, 9, 11, 1, 3, 5, 7]
CUM_RHO = [0.7833112346, 0.8175908028, 0.8340135163, 0.8472687423, 0.8610500406, 0.868260635, 0.8645963362,
           0.8605243927, 0.8549628746, 0.8478947481, 0.8400761505, 0.8286466418]
RHO_BY_TRANSFORM = {"count": 0.8286469931, "count-idf": 0.7137618684, "sqrt": 0.7535041796,
                    "binary": 0.0536861965, "gate-prob": 0.6538503231, "gate-logit": 0.6915932008}


def test_greedy_layer_selection_matches_reference():
    t = synthetic_trace(120, 12, 32, 4, seed=3, decode_steps=32)
    idf = ExpertIDF().fit(t.prefill_counts).idf_
    gates = {"gate-prob": t.prefill_gate_prob, "gate-logit": t.prefill_gate_logit}
    s = LayerSelector(n_pairs=2000, seed=1).fit(t.prefill_counts, t.decode_counts, t.decode_steps, idf, gates)
    assert s.transform_ == "count" and s.n_layers_ == 6
    assert s.order_.tolist() == ORDER
    np.testing.assert_allclose(s.cumulative_rho_, CUM_RHO, rtol=0, atol=1e-6)
    assert s.rho_by_transform_.keys() == RHO_BY_TRANSFORM.keys()
    for k, v in RHO_BY_TRANSFORM.items():
        assert s.rho_by_transform_[k] == pytest.approx(v, abs=1e-6), k


def test_fit_command_outputs_match_reference(tmp_path):
    write_trace(tmp_path / "t", synthetic_trace(150, 12, 32, 4, seed=4, decode_steps=32))
    run_fit(tmp_path / "t", tmp_path / "f", decoders=4, pairs=3000, figures=False)
    m = json.loads((tmp_path / "f" / "manifest.json").read_text())["metrics"]
    assert m["transform"] == "count" and m["n_layers_kept"] == 6 and m["cluster_sizes"] == [30, 30, 30, 30]
    assert m["rho_peak"] == pytest.approx(0.8512855047963571, abs=1e-6)
    assert m["objective"] == pytest.approx(10.266842681986995, rel=1e-9)
    ref = {"binary": -0.011581084037927564, "count": 0.8152459530281193, "count-idf": 0.6901794063232378,
           "gate-logit": 0.7104906993793397, "gate-prob": 0.6348472858606249, "sqrt": 0.7188654398848737}
    for k, v in ref.items():
        assert m["rho_by_transform"][k] == pytest.approx(v, abs=1e-6), k


def test_numpy_rank_equals_scipy_rankdata():
    from scipy.stats import rankdata

    from eldr_cli.stages.signature import _rank

    rng = np.random.default_rng(0)
    for x in (rng.random(5000), rng.integers(0, 40, 5000).astype(float), np.round(rng.random((3, 700)), 2),
              np.array([2.0]), np.zeros(9)):
        np.testing.assert_array_equal(_rank(x), rankdata(x, axis=-1))


@pytest.mark.parametrize("n,d", [(300, 900), (900, 300), (60, 2)])
def test_pca_axes_span_the_svd_axes(n, d):
    from eldr_cli.plots import _top2_axes

    rng = np.random.default_rng(n)
    X = rng.normal(size=(n, d))
    X[:, :2] *= (20.0, 10.0)[:d]  # two clear leading directions, as clustered signatures have
    Xc = X - X.mean(axis=0)
    V = _top2_axes(Xc)
    vt = np.linalg.svd(Xc, full_matrices=False)[2]
    np.testing.assert_allclose(np.abs((V * vt[:2].T).sum(axis=0)), 1.0, atol=1e-6)
    np.testing.assert_allclose(V.T @ V, np.eye(2), atol=1e-9)
