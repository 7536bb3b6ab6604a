"""Decode activation from the prefill signature (for the ``eldr-live`` decode policy, issue 21).

A decode step pays for the union of the experts its batch activates. To predict that union when a
request joins a decoder, the fit learns what a request's *decode* will activate from what its prefill
signature looks like: M prototypes in signature space (k-means on the calibration signatures) and, per
prototype, the mean per-step decode activation probability of its members::

    a_m(l, e) = mean over members r of  decode_counts_r(l, e) / decode_steps_r      (in [0, 1])

A request is predicted by its nearest prototype; row M of ``activation_`` is the mean over all
calibration requests (used for a request without a signature). Prototypes, not each request's own
vector, are what a decoder's live set counts, so replicas can share it as integer counts per
(decoder, prototype) that sum.
"""

from __future__ import annotations

import numpy as np

from eldr_cli.errors import InvalidParameterError

MAX_ACTIVATION = 0.999  # keeps log(1 - a) finite: no expert is certain to fire at every step


class DecodeActivation:
    """Prototypes [M, d] of unit signatures and their decode activation [M + 1, L, E] (float32).

    ``fit(signatures [R, d], decode_counts [R, L, E], decode_steps [R])``; rows with no decode step or an
    all-zero signature are left out. ``predict(signature [d]) -> prototype index``.
    """

    def __init__(self, n_prototypes: int = 32, seed: int = 0):
        self.n_prototypes = n_prototypes
        self.seed = seed

    def fit(self, signatures: np.ndarray, decode_counts: np.ndarray, decode_steps: np.ndarray) -> "DecodeActivation":
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
        act = np.asarray(decode_counts, dtype=np.float64)[ok] / steps[:, None, None]
        M = min(self.n_prototypes, int(ok.sum()) // 2)
        km = BalancedKMeans(M, balanced=False, seed=self.seed).fit(S)
        labels = np.asarray(km.labels_)
        out = np.empty((M + 1, *act.shape[1:]), dtype=np.float64)
        for m in range(M):
            members = labels == m
            out[m] = act[members].mean(axis=0) if members.any() else act.mean(axis=0)
        out[M] = act.mean(axis=0)
        self.prototypes_ = np.ascontiguousarray(km.centroids_, dtype=np.float64)
        self.activation_ = np.clip(out, 0.0, MAX_ACTIVATION).astype(np.float32)
        self.labels_ = labels  # prototype of each kept row
        self.sizes_ = np.bincount(labels, minlength=M)
        return self

    def predict(self, signature: np.ndarray) -> int:
        return int(np.argmax(self.prototypes_ @ np.asarray(signature, dtype=np.float64)))
