"""The per-request shrinkage of eldr-live's decode-activation predictor (issue 35): the request's own prefill
distribution f_r, the blend a_r = lam f_r + (1 - lam) A_m with lam = w T / (T + kappa) per layer, and how kappa
and w are tuned (leave-one-out over the prototype means). The estimator is :class:`eldr_cli.method.live.
DecodeActivation`; :mod:`eldr_cli.method.live_quality` scores the candidates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_ACTIVATION = 0.999  # keeps log(1 - a) finite: no expert is certain to fire at every step
KAPPAS = (0.0, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0, np.inf)  # prompt tokens worth the prototype's mean
LOSS_FLOOR = 1e-4  # log-loss: a predicted probability is read as at least this (a 0 would cost infinity)
TUNE_ROWS = 256  # kappa and w (2 numbers a layer) are tuned on at most this many rows: the fit's time stays bounded


def tune_rows(n: int, seed: int) -> np.ndarray:
    """The rows kappa and w are tuned on: all of ``n``, or a seeded sample of TUNE_ROWS."""
    if n <= TUNE_ROWS:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=TUNE_ROWS, replace=False))


def prefill_frequency(counts: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(f [..., L, E] float32: the share of a layer's prompt tokens that picked each expert, T [..., L]: the
    prompt tokens routed at each layer) of prefill counts [..., L, E] (int); dense layers: f 0, T 0."""
    f = np.array(counts, dtype=np.float32)  # a copy, divided in place
    tok = f.sum(axis=-1) / float(max(top_k, 1))
    f /= np.maximum(tok, 1e-9)[..., None]
    return np.clip(f, 0.0, 1.0, out=f), tok


def shrink(f: np.ndarray, tok: np.ndarray, proto: np.ndarray, kappa: np.ndarray,
           weight: np.ndarray) -> np.ndarray:
    """a = lam f + (1 - lam) A with lam = w T / (T + kappa) per layer; shapes [..., L, E], [..., L], [L]."""
    with np.errstate(invalid="ignore", divide="ignore"):
        lam = np.where(np.isinf(kappa), 0.0, weight * tok / (tok + np.where(np.isinf(kappa), 1.0, kappa)))
    lam = np.nan_to_num(lam, nan=0.0).astype(np.float32)[..., None]
    return np.clip(proto + lam * (f - proto), 0.0, MAX_ACTIVATION)


@dataclass(frozen=True)
class Shrinkage:
    """Per-layer (kappa [L], weight [L]); kappa inf and weight 0 are the prototype predictor."""

    kappa: np.ndarray
    weight: np.ndarray

    @classmethod
    def none(cls, n_layers: int) -> "Shrinkage":
        return cls(np.full(n_layers, np.inf), np.zeros(n_layers))


SUM_BLOCK = 512  # columns of the rows' activations converted to float64 at a time (one reused buffer)


def prototype_sums(act: np.ndarray, labels: np.ndarray, n_protos: int) -> np.ndarray:
    """Sum of the rows' activations per prototype [M, L, E] (float64; a matrix product of the prototypes' one-hot
    membership with the float64 activations, a block of columns at a time: BLAS sums each output over the rows in
    the same order whatever the block, so the values are those of one product, without an [R, L * E] float64 copy)."""
    onehot = np.zeros((n_protos, len(act)))
    onehot[labels, np.arange(len(act))] = 1.0
    flat = act.reshape(len(act), -1)
    out = np.empty((n_protos, flat.shape[1]))
    buf = np.empty((len(act), min(SUM_BLOCK, flat.shape[1])))
    for a in range(0, flat.shape[1], SUM_BLOCK):
        cols = flat[:, a:a + SUM_BLOCK]
        x = buf if cols.shape[1] == buf.shape[1] else np.empty(cols.shape)
        x[...] = cols
        np.matmul(onehot, x, out=out[:, a:a + SUM_BLOCK])
    return out.reshape(n_protos, *act.shape[1:])


def loo_prototype_means(act: np.ndarray, labels: np.ndarray, n_protos: int, rows: np.ndarray | None = None,
                        sums: np.ndarray | None = None) -> np.ndarray:
    """Each row's prototype mean without the row itself [R, L, E] (the global mean without it for a lone member);
    only for ``rows`` (indices; default all), each row's value the same bit for bit. ``sums``: the rows'
    :func:`prototype_sums`, when already computed."""
    sums = prototype_sums(act, labels, n_protos) if sums is None else sums
    n = np.bincount(labels, minlength=n_protos).astype(np.float64)
    rows = np.arange(len(act)) if rows is None else np.asarray(rows)
    a32 = np.asarray(act[rows], dtype=np.float32)
    lab = labels[rows]
    own = sums.astype(np.float32)[lab]
    own -= a32
    lone = n[lab] <= 1
    own /= np.maximum(n[lab] - 1, 1).astype(np.float32)[:, None, None]
    if lone.any():
        own[lone] = (sums.sum(axis=0).astype(np.float32) - a32[lone]) / max(len(act) - 1, 1)
    return own


def _kappa_sums(y: np.ndarray, f: np.ndarray, tok: np.ndarray, proto: np.ndarray):
    """For each kappa in KAPPAS (but inf), the per-layer least-squares terms (num [L], den [L]) of the weight w, and
    the prototype's own per-layer squared error ``base`` [L]: -> (base, [(kappa, num, den), ...]). The [R, L, E]
    products go through reused buffers (the same float32 products and float64 sums as fresh arrays)."""
    resid = proto - y
    d = f - proto
    gd, prod, sq = np.empty_like(d), np.empty_like(d), np.empty(d.shape, dtype=np.float64)

    def sum_sq(x: np.ndarray) -> np.ndarray:  # sum over rows and experts of float64(x)^2 (exact squares), per layer
        np.copyto(sq, x)
        return np.multiply(sq, sq, out=sq).sum(axis=(0, 2))

    base = sum_sq(resid)
    terms = []
    for k in KAPPAS[:-1]:
        g = (tok / (tok + k)) if k > 0 else (tok > 0).astype(np.float32)  # [R, L]
        np.multiply(g[..., None], d, out=gd)
        num = -np.multiply(resid, gd, out=prod).sum(axis=(0, 2), dtype=np.float64)
        terms.append((k, num, sum_sq(gd)))
    return base, terms


def _pick(base: np.ndarray, terms, per_layer: bool) -> Shrinkage:
    """The (kappa, w) of least squared error among :func:`_kappa_sums`' terms, per layer or one for all layers."""
    L = len(base)
    best_err = np.full(L, np.inf) if per_layer else np.array([np.inf])
    kappa = np.full(L, np.inf)
    weight = np.zeros(L)
    for k, num, den in terms:
        if not per_layer:
            num, den = num.sum(keepdims=True), den.sum(keepdims=True)
        w = np.clip(num / np.maximum(den, 1e-30), 0.0, 1.0)
        err = (base.sum(keepdims=True) if not per_layer else base) - 2 * w * num + w * w * den
        better = err < best_err - 1e-12
        best_err = np.where(better, err, best_err)
        if per_layer:
            kappa, weight = np.where(better, k, kappa), np.where(better, w, weight)
        elif better[0]:
            kappa, weight = np.full(L, k), np.full(L, float(w[0]))
    if per_layer:  # a layer where no shrinkage beats its prototype stays at kappa = inf
        keep = best_err < base - 1e-12
        kappa, weight = np.where(keep, kappa, np.inf), np.where(keep, weight, 0.0)
    return Shrinkage(kappa.astype(np.float64), weight.astype(np.float64))


def tune_shrinkage(y: np.ndarray, f: np.ndarray, tok: np.ndarray, proto: np.ndarray,
                   per_layer: bool = True) -> Shrinkage:
    """kappa_l and w_l minimizing the squared error of a_r against the true activation y [R, L, E], with each
    row's prototype mean ``proto`` [R, L, E] taken without the row (leave-one-out); for each kappa the best w
    has a closed form (least squares in w, clipped to [0, 1]). ``per_layer=False``: one (kappa, w) for all."""
    base, terms = _kappa_sums(y, f, tok, proto)
    return _pick(base, terms, per_layer=per_layer)


def tune_both(y: np.ndarray, f: np.ndarray, tok: np.ndarray, proto: np.ndarray) -> tuple[Shrinkage, Shrinkage]:
    """(one kappa, w for all layers; per layer): both :func:`tune_shrinkage` forms from one pass over the rows."""
    base, terms = _kappa_sums(y, f, tok, proto)
    return _pick(base, terms, per_layer=False), _pick(base, terms, per_layer=True)
