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

import numpy as np

from eldr_cli.errors import InvalidParameterError
from eldr_cli.method.live_quality import choose, predictor_quality
from eldr_cli.method.shrinkage import (
    MAX_ACTIVATION,
    Shrinkage,
    loo_prototype_means,
    prefill_frequency,
    prototype_sums,
    tune_both,
    tune_rows,
)
from eldr_cli.method.signature import rank_pool


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
        kept = (lambda a: a) if ok.all() else (lambda a: a[ok])  # no copy of [R, L, E] arrays where every row stays
        S, steps = kept(S), kept(steps)
        shrinking = self.shrink and prefill_counts is not None
        pool = rank_pool()  # independent numpy work (it releases the GIL) in a second thread; the same values
        freq = pool.submit(prefill_frequency, kept(np.asarray(prefill_counts)), top_k) if shrinking else None
        act = kept(np.asarray(decode_counts)).astype(np.float32)
        act /= steps[:, None, None].astype(np.float32)
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
        if freq is not None:
            # clipping changes nothing where no activation is above MAX_ACTIVATION: then y is act, the sums above y's
            same = bool(act.max(initial=0.0) <= MAX_ACTIVATION and act.min(initial=0.0) >= 0.0)
            y = act if same else np.clip(act, 0.0, MAX_ACTIVATION)
            f, tok = freq.result()
            # both forms, tuned again on (up to TUNE_ROWS of) every row, beside the measurement that picks one
            tuned = pool.submit(_tune_on_all, y, f, tok, labels, M, self.seed, sums if same else None)
            self.quality_ = predictor_quality(S, y, f, tok, labels, M, seed=self.seed)
            self.predictor_ = choose(self.quality_)
            one, per_layer = tuned.result()
            if self.predictor_ != "prototype":
                self.shrinkage_ = per_layer if self.predictor_ == "shrinkage" else one
        return self

    def predict(self, signature: np.ndarray) -> int:
        return int(np.argmax(self.prototypes_ @ np.asarray(signature, dtype=np.float64)))


def _tune_on_all(y, f, tok, labels, n_protos, seed, sums) -> tuple[Shrinkage, Shrinkage]:
    """(one kappa, w; per layer) tuned on TUNE_ROWS of all rows against their leave-one-out prototype means."""
    sub = tune_rows(len(y), seed)
    loo = loo_prototype_means(y, labels, n_protos, rows=sub, sums=sums)
    return tune_both(y[sub], f[sub], tok[sub], loo)
