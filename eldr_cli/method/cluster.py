"""Balanced K-means on unit signatures (ELDR §4.3.1).

The assignment step is the exact capacity-constrained transportation problem: every point goes to
one of K centroids, each centroid takes at most ceil(N/K) points, total cosine distance minimal.
It is solved as a min-cost flow with K sink nodes (OR-Tools' network simplex-free cost scaling
solver on integer costs) over a *pruned* arc set -- each point's ``m`` nearest centroids -- and the
result is then certified optimal on the full cost matrix: an assignment is optimal iff the residual
graph has no negative cycle, and that graph compresses to K+1 nodes (bins and the sink), where
edge k->k' costs min over points i in k of (c[i,k'] - c[i,k]). When the certificate fails, m doubles.
"""

from __future__ import annotations

import math

import numpy as np

from eldr_cli.constraints import validate_n_clusters
from eldr_cli.errors import InvalidDataError

COST_SCALE = 10**9  # cosine distances in [0, 2] -> int64; optimal to 1e-9 per point


def _residual_has_negative_cycle(cost: np.ndarray, labels: np.ndarray, capacity: int, tol: float) -> bool:
    """Optimality certificate of an assignment on the full cost matrix [N, K]."""
    N, K = cost.shape
    INF = np.inf
    W = np.full((K + 1, K + 1), INF)
    own = cost[np.arange(N), labels]
    sizes = np.bincount(labels, minlength=K)
    for k in range(K):
        pts = labels == k
        if pts.any():
            W[k, :K] = (cost[pts] - own[pts, None]).min(axis=0)
    np.fill_diagonal(W, INF)
    W[:K, K] = np.where(sizes < capacity, 0.0, INF)   # bin -> sink while it has room
    W[K, :K] = np.where(sizes > 0, 0.0, INF)          # sink -> bin (undo one unit of its flow)
    D = W.copy()
    for m in range(K + 1):  # Floyd-Warshall; a negative diagonal means a negative cycle
        D = np.minimum(D, D[:, m:m + 1] + D[m:m + 1, :])
    return bool((np.diag(D) < -tol).any())


def balanced_assignment(cost: np.ndarray, capacity: int, *, m: int | None = None) -> np.ndarray:
    """Exact min-total-cost assignment of N points to K bins of at most ``capacity`` points.

    cost: float [N, K] (cosine distances); returns int32 labels [N].
    """
    from ortools.graph.python import min_cost_flow

    cost = np.asarray(cost, dtype=np.float64)
    N, K = cost.shape
    if capacity * K < N:
        raise InvalidDataError(f"capacity {capacity} x {K} bins cannot hold {N} points")
    m = min(K, m or min(K, max(4, 2 * math.ceil(K ** 0.5))))
    icost = np.rint(cost * COST_SCALE).astype(np.int64)
    while True:
        if m >= K:
            cols = np.broadcast_to(np.arange(K), (N, K))
        else:
            cols = np.argpartition(cost, m - 1, axis=1)[:, :m]
        mm = cols.shape[1]
        smcf = min_cost_flow.SimpleMinCostFlow()
        src = np.repeat(np.arange(N, dtype=np.int32), mm)
        dst = (N + cols.reshape(-1)).astype(np.int32)
        arc_cost = icost[src, cols.reshape(-1)]
        smcf.add_arcs_with_capacity_and_unit_cost(src, dst, np.ones(N * mm, dtype=np.int64), arc_cost)
        sink = N + K
        smcf.add_arcs_with_capacity_and_unit_cost(
            np.arange(N, N + K, dtype=np.int32), np.full(K, sink, dtype=np.int32),
            np.full(K, capacity, dtype=np.int64), np.zeros(K, dtype=np.int64))
        supplies = np.concatenate([np.ones(N, dtype=np.int64), np.zeros(K, dtype=np.int64), [-N]])
        smcf.set_nodes_supplies(np.arange(N + K + 1, dtype=np.int32), supplies)
        status = smcf.solve()
        if status != smcf.OPTIMAL:
            if m >= K:
                raise RuntimeError(f"min-cost flow failed with status {status}")
            m = min(K, 2 * m)
            continue
        flows = smcf.flows(np.arange(N * mm, dtype=np.int32))
        chosen = flows.reshape(N, mm).argmax(axis=1)
        labels = cols[np.arange(N), chosen].astype(np.int32)
        if m >= K or not _residual_has_negative_cycle(cost, labels, capacity, tol=N * 2.0 / COST_SCALE):
            return labels
        m = min(K, 2 * m)


def assignment_cost(cost: np.ndarray, labels: np.ndarray) -> float:
    return float(np.asarray(cost)[np.arange(len(labels)), labels].sum())


class BalancedKMeans:
    """Spherical K-means whose assignment step is exact and capacity-constrained (§4.3.1).

    Parameters: ``n_clusters`` (K = number of decode workers), ``balanced`` (False: vanilla
    K-means, the ablation), ``max_iter``, ``tol`` (stop when the objective improves less),
    ``seed``. fit(X float [N, d], rows unit norm) -> self with ``centroids_`` [K, d] (unit norm),
    ``labels_`` int32 [N], ``objective_`` (total cosine distance), ``n_iter_``, ``sizes_``,
    ``capacity_`` = ceil(N / K).
    """

    def __init__(self, n_clusters: int = 16, *, balanced: bool = True, max_iter: int = 50,
                 tol: float = 1e-6, seed: int = 0):
        self.n_clusters = n_clusters
        self.balanced = balanced
        self.max_iter = max_iter
        self.tol = tol
        self.seed = seed

    def _init(self, X: np.ndarray, rng) -> np.ndarray:
        """k-means++ seeding on cosine distance (on a 20k-point sample when N is larger)."""
        if X.shape[0] > 20000:
            X = X[np.sort(rng.choice(X.shape[0], size=20000, replace=False))]
        N = X.shape[0]
        K = self.n_clusters
        idx = [int(rng.integers(N))]
        d = np.maximum(0.0, 1.0 - X @ X[idx[0]])
        for _ in range(1, K):
            p = d / d.sum() if d.sum() > 0 else np.full(N, 1.0 / N)
            nxt = int(rng.choice(N, p=p))
            idx.append(nxt)
            d = np.minimum(d, np.maximum(0.0, 1.0 - X @ X[nxt]))
        return X[idx].astype(np.float64)

    def _assign(self, cost: np.ndarray) -> np.ndarray:
        if self.balanced:
            return balanced_assignment(cost, self.capacity_)
        return cost.argmin(axis=1).astype(np.int32)

    def fit(self, X: np.ndarray, init: np.ndarray | None = None) -> "BalancedKMeans":
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[0] == 0:
            raise InvalidDataError(f"clustering needs signatures [N, d] with N >= 1, got shape {X.shape}")
        if not np.isfinite(X).all():
            raise InvalidDataError("signatures contain NaN or infinite values")
        N, d = X.shape
        K = self.n_clusters
        validate_n_clusters(K.item() if isinstance(K, np.integer) else K, N)
        if X.dtype != np.float32:
            X = X.astype(np.float64, copy=False)
        rng = np.random.default_rng(self.seed)
        self.capacity_ = math.ceil(N / K)
        C = self._init(X, rng) if init is None else np.asarray(init, dtype=np.float64)
        prev_obj = np.inf
        labels = None
        self.n_iter_ = 0
        for it in range(self.max_iter):
            cost = 1.0 - (X @ C.T.astype(X.dtype)).astype(np.float64)
            new = self._assign(cost)
            obj = assignment_cost(cost, new)
            self.n_iter_ = it + 1
            converged = labels is not None and np.array_equal(new, labels)
            labels = new
            C = self._update(X, labels, C, rng)
            if converged or prev_obj - obj <= self.tol * max(1.0, abs(obj)):
                break
            prev_obj = obj
        assert labels is not None  # max_iter >= 1: the loop assigned at least once
        cost = 1.0 - (X @ C.T.astype(X.dtype)).astype(np.float64)
        self.labels_ = labels
        self.centroids_ = C
        self.objective_ = assignment_cost(cost, labels)
        self.sizes_ = np.bincount(labels, minlength=K)
        return self

    def _update(self, X, labels, C, rng) -> np.ndarray:
        K = self.n_clusters
        # [K, d] per-cluster sums, rows added in order (the same sums, bit for bit, as the sparse one-hot
        # product used before; importing scipy.sparse cost more than the whole update at N=1,000)
        sums = np.stack([X[labels == k].sum(axis=0) for k in range(K)]).astype(np.float64)
        norms = np.linalg.norm(sums, axis=1)
        out = C.copy()
        ok = norms > 0
        out[ok] = sums[ok] / norms[ok, None]
        # an empty cluster (vanilla only) keeps its centroid
        return out
