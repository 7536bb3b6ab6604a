"""Policy `oracle` (simulate only): decode-pattern clusters, the same band rule, the share ELDR covers."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_cli.stages.oracle import OracleModel, OraclePolicy, decode_patterns, oracle_share
from eldr_cli.stages.routing import POLICIES


def test_oracle_is_not_offered_to_the_proxy():
    assert "oracle" not in POLICIES


def test_oracle_groups_rows_by_their_decode_pattern():
    rng = np.random.default_rng(0)
    R, L, E, K = 64, 4, 32, 4
    dom = np.arange(R) % K
    counts = np.zeros((R, L, E))
    for r in range(R):  # domain d decodes on experts [8d, 8d+8)
        counts[r, :, 8 * dom[r]:8 * dom[r] + 8] = rng.integers(1, 5, size=(L, 8))
    om = OracleModel(counts, np.arange(R), K, tau=0.0)
    pol = OraclePolicy(K, om)
    loads = [0] * K
    chosen = [pol.choose(loads, signature=om.signature(r)) for r in range(R)]
    # every domain lands on exactly one worker, and distinct domains on distinct workers
    by_dom = {d: {c for c, dd in zip(chosen, dom, strict=True) if dd == d} for d in range(K)}
    assert all(len(v) == 1 for v in by_dom.values())
    assert len({next(iter(v)) for v in by_dom.values()}) == K
    # no signature -> least-loaded worker
    assert pol.choose([3, 1, 2, 5], signature=None) == 1


def test_patterns_are_unit_and_share_arithmetic():
    p = decode_patterns(np.ones((3, 2, 4)))
    assert np.allclose(np.linalg.norm(p, axis=1), 1.0)
    assert oracle_share(10.0, 8.0, 6.0) == pytest.approx(50.0)
    assert oracle_share(10.0, 8.0, 10.0) is None  # no distance to cover
