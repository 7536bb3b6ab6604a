"""The step-cluster oracle (router name ``oracle``; replay and simulation only).

Not a limit: its clusters come from the served rows' few captured decode steps, and ELDR can beat it (it did on
the held-out Llama-4 trace). The limit row is ``routing.clairvoyant`` (eldr-live's rule on true future
activations), whose activations :func:`fit_oracle` also computes (``future``).

It knows what no router can know at admission: each request's *decode* expert pattern. Balanced
clusters (K = decode workers) are fitted on the decode counts of the very rows being served, and
requests are routed by the same locality-band rule as ELDR (``routing.policies.locality_band``) on
that pattern. ELDR sees only the prefill pattern, but its clusters come from all the prompt tokens; comparisons
show how much of the distance from the best load balancer to this oracle ELDR covers (and when it passes it).
"""

from __future__ import annotations

import math

import numpy as np

from eldr_cli.routing.policies import Policy, Ranking, band_ranking, jsq


def decode_patterns(decode_counts: np.ndarray) -> np.ndarray:
    """[R, L, E] decode counts -> unit rows [R, L*E] (sqrt-damped, like the servable signatures)."""
    x = np.sqrt(np.asarray(decode_counts, dtype=np.float64).reshape(decode_counts.shape[0], -1))
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


class OracleModel:
    """Balanced clusters on the served rows' decode patterns; ``signature(row)`` is that row's pattern."""

    def __init__(self, decode_counts: np.ndarray, rows: np.ndarray, n_workers: int, *, tau: float = 0.1,
                 seed: int = 0, signature=None):
        """``signature``: counts [L, E] -> unit vector; ELDR's own signature function (layers, transform)
        when a routing model is at hand, so the oracle differs from ELDR only in *seeing decode*."""
        from eldr_cli.method.cluster import BalancedKMeans

        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if signature is None:
            vecs = decode_patterns(np.asarray(decode_counts[rows]))
        else:
            vecs = np.stack([np.asarray(signature(np.asarray(decode_counts[r])), dtype=np.float64) for r in rows])
        self.patterns = {int(r): v for r, v in zip(rows, vecs, strict=True)}
        X = np.stack([self.patterns[int(r)] for r in rows])
        k = min(n_workers, X.shape[0])
        km = BalancedKMeans(k, seed=seed).fit(X)
        cents = np.asarray(km.centroids_, dtype=np.float64)
        if k < n_workers:  # fewer served rows than workers: the spare workers get no cluster
            cents = np.vstack([cents, np.zeros((n_workers - k, cents.shape[1]))])
        self.centroids = np.ascontiguousarray(cents)
        self.tau = float(tau)
        self.future: dict[int, np.ndarray] | None = None  # the rows' true activations (fit_oracle's decode_steps)

    def signature(self, row: int) -> np.ndarray:
        return self.patterns[int(row)]


class OraclePolicy(Policy):
    """The band rule on the request's own decode pattern (JSQ when it has none)."""

    name = "oracle"
    needs_signature = True
    needs_counts = False  # its signature is the request's own decode pattern, looked up by the request's key

    def __init__(self, n_workers: int, oracle: OracleModel, tau: float | None = None):
        self.oracle = oracle
        self.tau = oracle.tau if tau is None else float(tau)

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        if signature is None or not math.isfinite(float(np.abs(signature).sum())) or not signature.any():
            return Ranking(jsq(loads))
        return band_ranking(signature, self.oracle.centroids, loads, self.tau)


def fit_oracle(decode_counts: np.ndarray, rows: np.ndarray, n_workers: int, *, model=None,
               tau: float | None = None, seed: int = 0, decode_steps: np.ndarray | None = None) -> OracleModel:
    """The oracle of the served ``rows``: with a routing ``model``, patterns are ELDR's own signature of the
    decode counts and tau is the model's unless given; without one, sqrt-damped decode patterns, tau 0.1.
    With ``decode_steps``, it also holds the rows' true per-step activations (``future``), which the
    clairvoyant router (``routing.clairvoyant``) is fed."""
    if tau is None:
        tau = model.tau if model is not None else 0.1
    om = OracleModel(np.asarray(decode_counts), rows, n_workers, tau=tau, seed=seed,
                     signature=None if model is None else model.signature)
    if decode_steps is not None:
        from eldr_cli.routing.clairvoyant import future_activations

        om.future = future_activations(decode_counts, decode_steps, rows)
    return om


def oracle_share(lb: float, eldr: float, oracle: float) -> float | None:
    """Share (%) of the best-load-balancer-to-oracle distance ELDR covers (None when there is none)."""
    gap = lb - oracle
    if not all(map(math.isfinite, (lb, eldr, oracle))) or gap <= 1e-12:
        return None
    return 100.0 * (lb - eldr) / gap
