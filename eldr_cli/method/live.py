"""Decode activation from the prefill (for the ``eldr-live`` decode policy, issues 21 and 35).

A decode step pays for the union of the experts its batch activates. To predict that union when a
request joins a decoder, the fit learns what a request's *decode* will activate from its prefill. Two parts:

- M prototypes in signature space (k-means on the calibration signatures) and, per prototype, the mean
  per-step decode activation probability of its members (row M: the mean over all requests)::

      A_m(l, e) = mean over members r of  decode_counts_r(l, e) / decode_steps_r      (in [0, 1])

- a per-layer shrinkage of the request's *own* prefill distribution toward its prototype's mean::

      f_r(l, e)  = prefill_counts_r(l, e) / T_r(l)        T_r(l) = prefill tokens at layer l (sum_e c / k)
      lam_r(l)   = w_l * T_r(l) / (T_r(l) + kappa_l)
      a_r(l, e)  = lam_r(l) * f_r(l, e) + (1 - lam_r(l)) * A_m(l, e)

  Both f_r and A_m sum to k over a layer's experts (a token picks k experts; a decode step is one token), so
  the blend is a distribution of the same kind. kappa_l (how many prompt tokens make the request's own
  distribution as trustworthy as its prototype's) and w_l (how far decode follows prefill at all) are learned
  per layer on the calibration trace by leave-one-out over the prototype means (:func:`tune_shrinkage`).
  kappa = inf is today's prototype predictor; the fit keeps it where the shrinkage does not win.

:func:`predictor_quality` measures candidates on a held-back split (per-step Brier and log-loss of a_r, and the
error of the predicted distinct experts of random batches) so a user sees what the predictor buys before a report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr_cli.errors import InvalidParameterError

MAX_ACTIVATION = 0.999  # keeps log(1 - a) finite: no expert is certain to fire at every step
KAPPAS = (0.0, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0, np.inf)  # prompt tokens worth the prototype's mean
LOSS_FLOOR = 1e-4  # log-loss: a predicted probability is read as at least this (a 0 would cost infinity)
TUNE_ROWS = 512  # kappa and w (2 numbers a layer) are tuned on at most this many rows: the fit's time stays bounded


def tune_rows(n: int, seed: int) -> np.ndarray:
    """The rows kappa and w are tuned on: all of ``n``, or a seeded sample of TUNE_ROWS."""
    if n <= TUNE_ROWS:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=TUNE_ROWS, replace=False))


def prefill_frequency(counts: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(f [..., L, E] float32: the share of a layer's prompt tokens that picked each expert, T [..., L]: the
    prompt tokens routed at each layer) of prefill counts [..., L, E] (int); dense layers: f 0, T 0."""
    c = np.asarray(counts, dtype=np.float32)
    tok = c.sum(axis=-1) / float(max(top_k, 1))
    f = c / np.maximum(tok, 1e-9)[..., None]
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


def prototype_sums(act: np.ndarray, labels: np.ndarray, n_protos: int) -> np.ndarray:
    """Sum of the rows' activations per prototype [M, L, E] (float64; one matrix product)."""
    onehot = np.zeros((n_protos, len(act)))
    onehot[labels, np.arange(len(act))] = 1.0
    return (onehot @ act.reshape(len(act), -1).astype(np.float64)).reshape(n_protos, *act.shape[1:])


def loo_prototype_means(act: np.ndarray, labels: np.ndarray, n_protos: int) -> np.ndarray:
    """Each row's prototype mean without the row itself [R, L, E] (the global mean without it for a lone member)."""
    sums = prototype_sums(act, labels, n_protos)
    n = np.bincount(labels, minlength=n_protos).astype(np.float64)
    total = sums.sum(axis=0)
    a32 = np.asarray(act, dtype=np.float32)
    own = sums.astype(np.float32)[labels]
    own -= a32
    lone = n[labels] <= 1
    own /= np.maximum(n[labels] - 1, 1).astype(np.float32)[:, None, None]
    if lone.any():
        own[lone] = (total.astype(np.float32) - a32[lone]) / max(len(act) - 1, 1)
    return own


def tune_shrinkage(y: np.ndarray, f: np.ndarray, tok: np.ndarray, proto: np.ndarray,
                   per_layer: bool = True) -> Shrinkage:
    """kappa_l and w_l minimizing the squared error of a_r against the true activation y [R, L, E], with each
    row's prototype mean ``proto`` [R, L, E] taken without the row (leave-one-out); for each kappa the best w
    has a closed form (least squares in w, clipped to [0, 1]). ``per_layer=False``: one (kappa, w) for all."""
    L = y.shape[1]
    resid = proto - y
    d = f - proto
    best_err = np.full(L, np.inf) if per_layer else np.array([np.inf])
    kappa = np.full(L, np.inf)
    weight = np.zeros(L)
    base = (resid.astype(np.float64) ** 2).sum(axis=(0, 2))
    for k in KAPPAS[:-1]:
        g = (tok / (tok + k)) if k > 0 else (tok > 0).astype(np.float32)  # [R, L]
        gd = g[..., None] * d
        num = -(resid * gd).sum(axis=(0, 2), dtype=np.float64)
        den = (gd.astype(np.float64) ** 2).sum(axis=(0, 2))
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


class DecodeActivation:
    """Prototypes [M, d] of unit signatures, their decode activation [M + 1, L, E] (float32) and the per-layer
    shrinkage of a request's own prefill distribution toward them (``shrinkage_``).

    ``fit(signatures [R, d], decode_counts [R, L, E], decode_steps [R], prefill_counts [R, L, E], top_k)``;
    rows with no decode step or an all-zero signature are left out. Without ``prefill_counts`` (or with
    ``shrink=False``) the predictor is the prototype's mean alone.
    """

    def __init__(self, n_prototypes: int = 32, seed: int = 0, shrink: bool = True):
        self.n_prototypes = n_prototypes
        self.seed = seed
        self.shrink = shrink

    def fit(self, signatures: np.ndarray, decode_counts: np.ndarray, decode_steps: np.ndarray,
            prefill_counts: np.ndarray | None = None, top_k: int = 1) -> "DecodeActivation":
        from eldr_cli.method.cluster import BalancedKMeans

        if not isinstance(self.n_prototypes, int) or self.n_prototypes < 1:
            raise InvalidParameterError("n_prototypes",
                                        f"n_prototypes must be an integer >= 1, got {self.n_prototypes!r}")
        S = np.asarray(signatures, dtype=np.float64)
        steps = np.asarray(decode_steps, dtype=np.float64)
        ok = (steps > 0) & (np.linalg.norm(S, axis=1) > 0)
        if ok.sum() < 2:
            raise InvalidParameterError("signatures", "at least 2 calibration requests with decode steps are needed")
        S, steps = S[ok], steps[ok]
        act = np.asarray(decode_counts)[ok].astype(np.float32) / steps[:, None, None].astype(np.float32)
        M = min(self.n_prototypes, int(ok.sum()) // 2)
        km = BalancedKMeans(M, balanced=False, seed=self.seed).fit(S)
        labels = np.asarray(km.labels_)
        sums = prototype_sums(act, labels, M)
        n = np.bincount(labels, minlength=M)
        out = np.empty((M + 1, *act.shape[1:]), dtype=np.float64)
        out[M] = sums.sum(axis=0) / len(act)
        out[:M] = np.where((n > 0)[:, None, None], sums / np.maximum(n, 1)[:, None, None], out[M])
        self.prototypes_ = np.ascontiguousarray(km.centroids_, dtype=np.float64)
        self.activation_ = np.clip(out, 0.0, MAX_ACTIVATION).astype(np.float32)
        self.labels_ = labels  # prototype of each kept row
        self.sizes_ = np.bincount(labels, minlength=M)
        self.top_k_ = int(top_k)
        self.shrinkage_ = Shrinkage.none(act.shape[1])
        self.quality_: dict[str, dict[str, float]] | None = None
        self.predictor_ = "prototype"
        if self.shrink and prefill_counts is not None:
            from eldr_cli.method.live_quality import choose, predictor_quality

            pc = np.asarray(prefill_counts)[ok]
            y = np.clip(act, 0.0, MAX_ACTIVATION)
            self.quality_ = predictor_quality(S, y, pc, top_k, labels, M, seed=self.seed)
            self.predictor_ = choose(self.quality_)
            if self.predictor_ != "prototype":  # the chosen form, tuned again on (up to TUNE_ROWS of) every row
                f, tok = prefill_frequency(pc, top_k)
                loo = loo_prototype_means(y, labels, M)
                sub = tune_rows(len(y), self.seed)
                self.shrinkage_ = tune_shrinkage(y[sub], f[sub], tok[sub], loo[sub],
                                                 per_layer=self.predictor_ == "shrinkage")
        return self

    def predict(self, signature: np.ndarray) -> int:
        return int(np.argmax(self.prototypes_ @ np.asarray(signature, dtype=np.float64)))
