"""Expert signatures (ELDR §4.2): transforms, decode patterns and signature quality rho (Eq. 1).

Shapes: counts int [R, L, E]; a signature is float [N* x E] (masked layers, weighted, unit norm).
"""

from __future__ import annotations

import numpy as np

from eldr_cli.constraints import TRANSFORMS, StrOptions
from eldr_cli.errors import InvalidDataError, InvalidParameterError

# §4.2.3 / Fig. 7: of the six candidate transforms only the count-derived ones can be computed from
# what the prefill worker hands off (integer counts), so only they are servable by the proxy.
SERVABLE_TRANSFORMS = ("count", "count-idf", "sqrt", "binary")


def apply_transform(counts: np.ndarray, transform: str, idf: np.ndarray | None = None) -> np.ndarray:
    """Per-cell transform of counts [..., L, E] -> float64 [..., L, E] (before masking/normalizing).

    Gate transforms take the summed gate scores in place of ``counts``.
    """
    c = np.asarray(counts, dtype=np.float64)
    if transform in ("count", "gate-prob", "gate-logit"):
        return c
    if transform == "count-idf":
        if idf is None:
            raise InvalidDataError("transform count-idf needs an IDF table (run `eldr fit-idf` first)")
        return c * idf
    if transform == "sqrt":
        return np.sqrt(c)
    if transform == "binary":
        return (c > 0).astype(np.float64)
    raise InvalidParameterError("transform", StrOptions(TRANSFORMS).refusal(transform, "transform"))


def l2_normalize(x: np.ndarray, axis: int = -1) -> np.ndarray:
    n = np.linalg.norm(x, axis=axis, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x, dtype=np.float64), where=n > 0)


def signatures(counts: np.ndarray, transform: str, weights: np.ndarray | None, mask, *,
               unit: bool = True) -> np.ndarray:
    """Eq. 2 for a batch: counts [R, L, E] -> unit signatures [R, |mask| * E]. ``unit=False`` stops before
    the normalization (the same directions, for a caller that only ranks dot products with one signature)."""
    c = np.asarray(counts)[:, mask, :]
    x = weighted_cells(c, transform, None if weights is None else np.asarray(weights, dtype=np.float64)[mask])
    x = x.reshape(x.shape[0], -1)
    return l2_normalize(x) if unit else x


def weighted_cells(c: np.ndarray, transform: str, weights: np.ndarray | None) -> np.ndarray:
    """Eq. 2's cells before flattening: the kept layers' counts [..., N*, E] transformed and weighted by the kept
    layers' float64 ``weights`` [N*, E] (None: unweighted); :func:`signatures` and ``RoutingModel.signature``."""
    if weights is None:
        return apply_transform(c, transform)
    if transform == "count-idf":
        return apply_transform(c, transform, weights)
    # per-cell weights on any transform (ones, or learned per-layer weights: method.layer_weights)
    return apply_transform(c, transform) * weights


def decode_pattern(decode_counts: np.ndarray, decode_steps: np.ndarray) -> np.ndarray:
    """§4.2.1 target: p_r(l, e) = fraction of r's decode steps picking e at l; flat, unit norm [R, L*E]."""
    steps = np.maximum(np.asarray(decode_steps, dtype=np.float64), 1.0)
    p = np.asarray(decode_counts, dtype=np.float64) / steps[:, None, None]
    return l2_normalize(p.reshape(p.shape[0], -1))


def sample_pairs(n: int, n_pairs: int, seed: int = 0) -> np.ndarray:
    """A fixed-seed sample of ``n_pairs`` ordered pairs (i, j), i != j, as int64 [P, 2]."""
    if n < 2:
        raise InvalidDataError(f"signature quality needs at least 2 requests, got {n}")
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, size=n_pairs)
    j = rng.integers(0, n - 1, size=n_pairs)
    j = j + (j >= i)  # uniform over j != i
    return np.stack([i, j], axis=1)


def _rank(x: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank), as scipy.stats.rankdata.

    In numpy: importing scipy.stats alone costs about a second of every `eldr fit`.
    """
    x = np.asarray(x)
    order = np.argsort(x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    n = x.shape[-1]
    new_group = np.ones(xs.shape, dtype=bool)
    new_group[..., 1:] = xs[..., 1:] != xs[..., :-1]
    flat = new_group.reshape(-1, n)
    out = np.empty(flat.shape, dtype=np.float64)
    for row, g in enumerate(flat):  # one row for the target ranking; rows are independent
        starts = np.flatnonzero(g)
        sizes = np.diff(np.append(starts, n))
        avg = starts + (sizes - 1) / 2.0 + 1.0
        out[row] = np.repeat(avg, sizes)
    ranks = np.empty(flat.shape, dtype=np.float64)
    np.put_along_axis(ranks, order.reshape(-1, n), out, axis=-1)
    return ranks.reshape(x.shape)


def _sorted_keys(d: np.ndarray, resolution: str):
    """Sort each row of distances; return (order, sorted keys) at the given key resolution.

    float32: one SIMD sort of packed keys (float32 bits << 32 | position). u16: distances scaled to
    0..65535 and ranked by numpy's radix argsort with ordinal ranks, several times faster again; this
    moves rho by ~1e-6 (the pair sample's own sd is ~5e-3) and is used only to screen candidates.
    """
    C, P = d.shape
    if resolution == "u16":
        top = float(d.max()) if d.size else 0.0
        q = np.rint(np.maximum(d, 0.0) * (65535.0 / top if top > 0 else 0.0)).astype(np.uint16)
        order = np.argsort(q, axis=1, kind="stable")
        return order, np.take_along_axis(q, order, axis=1)
    bits = np.maximum(d, 0.0).astype(np.float32).view(np.uint32).astype(np.uint64)
    key = np.sort((bits << np.uint64(32)) | np.arange(P, dtype=np.uint64), axis=1)
    return (key & np.uint64(0xFFFFFFFF)).astype(np.intp), key >> np.uint64(32)


def _spearman_rows(d: np.ndarray, target_rank_centered: np.ndarray, t_norm: float,
                   resolution: str = "float32") -> np.ndarray:
    """Spearman of each row of d against the target, average ranks for ties (as scipy's rankdata)."""
    C, P = d.shape
    order, sd = _sorted_keys(d, resolution)
    t_sorted = np.take(target_rank_centered, order)
    if resolution == "u16":
        # candidate screening: ordinal ranks (ties at 16-bit resolution broken by position)
        num = t_sorted @ np.arange(1, P + 1, dtype=np.float64)
        return num / (np.sqrt(P * (P * P - 1) / 12.0) * t_norm) if t_norm > 0 else np.zeros(C)
    new_group = np.ones((C, P), dtype=bool)
    new_group[:, 1:] = sd[:, 1:] != sd[:, :-1]
    if new_group.all():
        # no ties: ranks are 1..P in sorted order; centered rank norm^2 = P(P^2-1)/12
        num = t_sorted @ np.arange(1, P + 1, dtype=np.float64)
        den = np.full(C, np.sqrt(P * (P * P - 1) / 12.0) * t_norm)
    else:
        flat = new_group.ravel()
        gid = np.cumsum(flat) - 1
        starts = np.flatnonzero(flat)
        sizes = np.diff(np.append(starts, flat.size))
        avg = (starts % P) + (sizes - 1) / 2.0 + 1.0  # average 1-based rank of each tie group
        ranks = avg[gid].reshape(C, P) - (P + 1) / 2.0
        num = (ranks * t_sorted).sum(axis=1)
        den = np.sqrt((ranks * ranks).sum(axis=1)) * t_norm
    return np.divide(num, den, out=np.zeros(C), where=den > 0)


_POOL = None


def rank_pool():
    """Two threads for the fit's row-independent numpy work (sorts and ufuncs release the GIL)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(2, thread_name_prefix="eldr-rank")
    return _POOL


def spearman_to_target(dist: np.ndarray, target_rank_centered: np.ndarray, resolution: str = "float32") -> np.ndarray:
    """Spearman rho of each row of ``dist`` [C, P] against a target whose centered ranks are given
    (ranking at float32 resolution; see :func:`_spearman_rows`). Rows are split over two threads
    (numpy's sort releases the GIL)."""
    d = np.atleast_2d(np.asarray(dist, dtype=np.float64))
    t_norm = float(np.sqrt(target_rank_centered @ target_rank_centered))
    if d.shape[0] < 4:
        return _spearman_rows(d, target_rank_centered, t_norm, resolution)
    half = d.shape[0] // 2
    parts = list(rank_pool().map(lambda s: _spearman_rows(d[s], target_rank_centered, t_norm, resolution),
                                 (slice(0, half), slice(half, None))))
    return np.concatenate(parts)


def _grouped_pair_dots(x: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Per-layer dot products <x_i(l), x_j(l)> for pairs [P, 2]: x [R, L, E] -> [L, P].

    Pairs are grouped by their first request, so each request's row is read once and multiplied
    with its partners' rows (P * L * E multiply-adds, not the R^2 of a Gram matrix).
    """
    R, L, E = x.shape
    P = len(pairs)
    out = np.empty((L, P), dtype=np.float64)
    order = np.argsort(pairs[:, 0], kind="stable")
    pi, pj = pairs[order, 0], pairs[order, 1]
    bounds = np.flatnonzero(np.diff(pi)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [P]])
    res = np.empty((L, P), dtype=np.float64)
    for a, b in zip(starts, ends, strict=True):
        res[:, a:b] = np.matmul(x[pj[a:b]].transpose(1, 0, 2), x[pi[a], :, :, None])[..., 0]
    out[:, order] = res
    return out


def pair_cosine_distance(s: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """1 - cos(s_i, s_j) for unit-norm rows of s [R, d] over pairs [P, 2] (float64)."""
    return 1.0 - _grouped_pair_dots(np.asarray(s)[:, None, :], pairs)[0]


def pair_cosine_distance_fast(x: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Cosine distance over pairs of the rows of x [R, ...] (normalized here), in float32.

    For up to 4096 requests one float32 Gram matrix (a single SGEMM) beats gathering pair rows;
    distances carry float32 rounding (~1e-7), below the float32 resolution rho is ranked at.
    """
    return _pair_cosine_distance_f32(np.asarray(x).reshape(len(x), -1).astype(np.float32), pairs)


_CONTROLLER: list = []  # [(the extension modules loaded when built, threadpoolctl.ThreadpoolController)]


def blas_threads(n: int | None = None):
    """Context that runs BLAS on ``n`` threads (None: one per core this process may use); a no-op
    without threadpoolctl. The fit runs its many small products on one thread (on busy cores
    OpenBLAS's spinning threads cost more than they gain) and each large Gram matrix on all cores.
    The libraries are found once (5-20 ms with a fit's imports loaded) and again only after another extension
    module was imported (whose library may bring another BLAS)."""
    import os
    import sys

    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: BLAS keeps whatever threads it has
        import contextlib

        return contextlib.nullcontext()
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    seen = sum(1 for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").endswith((".so", ".pyd")))
    if not _CONTROLLER or _CONTROLLER[0][0] != seen:
        _CONTROLLER[:] = [(seen, ThreadpoolController())]
    return _CONTROLLER[0][1].limit(limits=max(1, n), user_api="blas")


def _pair_cosine_distance_f32(x: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """pair_cosine_distance_fast on a float32 [R, D] array it may normalize in place."""
    n = np.linalg.norm(x, axis=1)
    x /= np.where(n > 0, n, 1.0)[:, None]
    if len(x) <= 4096:
        # one large SGEMM gains from every core (~0.07 -> 0.04 s for 1,000 x 6,144 on two) and its
        # result is the same bit for bit: OpenBLAS splits the output, not the sums (tested)
        with blas_threads():
            g = x @ x.T
        return 1.0 - g[pairs[:, 0], pairs[:, 1]].astype(np.float64)
    return 1.0 - _grouped_pair_dots(x[:, None, :], pairs)[0]


def transformed_f32(src: np.ndarray, transform: str, idf: np.ndarray | None = None, block: int = 64) -> np.ndarray:
    """``apply_transform(src, transform, idf).astype(np.float32)`` bit for bit, a block of rows at a
    time: the float64 copy of a whole [R, L, E] source cost more (allocation, page faults, a second
    pass) than the transform itself."""
    src = np.asarray(src)
    out = np.empty(src.shape, dtype=np.float32)
    for a in range(0, len(src), block):
        out[a:a + block] = apply_transform(src[a:a + block], transform, idf)  # same float64->float32 cast
    if len(src) == 0:
        apply_transform(src, transform, idf)  # still reject an unknown transform
    return out


def pair_cosine_distance_transformed(src: np.ndarray, transform: str, idf: np.ndarray | None,
                                     pairs: np.ndarray) -> np.ndarray:
    """``pair_cosine_distance_fast(apply_transform(src, transform, idf), pairs)``, the same float32 values,
    without the float64 intermediate."""
    x = transformed_f32(src, transform, idf)
    return _pair_cosine_distance_f32(x.reshape(len(x), -1), pairs)


def signature_quality(sig: np.ndarray, pattern: np.ndarray, pairs: np.ndarray) -> float:
    """Eq. 1: Spearman(cos-dist(s_i, s_j), cos-dist(p_i, p_j)) over ``pairs``."""
    from scipy.stats import spearmanr

    return float(spearmanr(pair_cosine_distance(sig, pairs), pair_cosine_distance(pattern, pairs)).statistic)


class PairLayerCache:
    """Per-layer pair dot products and per-layer squared norms, so that the cosine distance of any
    layer mask over the fixed pair sample costs O(|mask| * P) instead of O(P * |mask| * E).

    x: float [R, L, E] (transformed, weighted, not normalized); pairs int [P, 2].
    dots: [L, P] = <x_i(l), x_j(l)>;  norms: [L, R] = ||x_r(l)||^2.
    """

    def __init__(self, x: np.ndarray, pairs: np.ndarray):
        self.pairs = pairs
        self.dots = _grouped_pair_dots(np.asarray(x, dtype=np.float64), pairs)  # [L, P]
        self.norms = np.einsum("rle,rle->lr", x, x)  # [L, R]
        self.ni = self.norms[:, pairs[:, 0]]  # [L, P]
        self.nj = self.norms[:, pairs[:, 1]]

    def distances_adding(self, dot: np.ndarray, ni: np.ndarray, nj: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """[len(layers), P]: ``distance(dot + dots[l], ni + ni[l], nj + nj[l])`` for each layer l, bit for bit,
        a row at a time in reused buffers (the greedy selection scores ~L^2/2 such rows; gathering
        [candidates, P] copies first and then walking them several times cost ~3x more)."""
        out = np.empty((len(layers), len(dot)))
        den = np.empty_like(dot)
        tmp = np.empty_like(dot)
        pos = np.empty(len(dot), dtype=bool)
        for c, l in enumerate(layers):
            np.add(ni, self.ni[l], out=den)
            np.add(nj, self.nj[l], out=tmp)
            np.multiply(den, tmp, out=den)
            np.sqrt(den, out=den)
            np.add(dot, self.dots[l], out=tmp)
            np.greater(den, 0, out=pos)
            row = out[c]
            row.fill(0.0)
            np.divide(tmp, den, out=row, where=pos)
            np.subtract(1.0, row, out=row)
        return out

    def distance(self, dot_sum: np.ndarray, ni_sum: np.ndarray, nj_sum: np.ndarray) -> np.ndarray:
        den = np.sqrt(ni_sum * nj_sum)
        cos = np.divide(dot_sum, den, out=np.zeros_like(dot_sum), where=den > 0)
        return 1.0 - cos
