"""Drift: how well the signatures of the traffic served fit the routing artifact.

At fit time :func:`calibration_stats` measures, over the calibration signatures, each one's cosine to its
nearest centroid and to its nearest eldr-live prototype, and the share of requests whose locality band
covers every decoder (there the band routes like JSQ). The routing artifact stores them (``params.drift``).
While serving, :class:`DriftMonitor` keeps the same quantities over the last ``window`` requests; the
traffic has *drifted* when a full window's mean similarity falls more than ``DRIFT_SIGMAS`` calibration
standard deviations below the calibration mean (to the centroids or to the prototypes): the average request
then fits the clusters worse than a one-in-six poorly fitting calibration request.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

DRIFT_SIGMAS = 1.0
WINDOW = 256


def _stats(sims: np.ndarray) -> dict[str, float]:
    m, sd = float(sims.mean()), float(sims.std())
    q05, q50, q95 = (float(x) for x in np.quantile(sims, [0.05, 0.5, 0.95]))
    return {"mean": m, "std": sd, "q05": q05, "q50": q50, "q95": q95, "threshold": m - DRIFT_SIGMAS * sd,
            "n": int(sims.size)}


def calibration_stats(S: np.ndarray, centroids: np.ndarray, prototypes: np.ndarray | None, tau: float) -> dict:
    """``S`` float [R, d] unit calibration signatures, ``centroids`` [K, d], ``prototypes`` [M, d] or None ->
    the artifact's ``drift`` block (JSON-able)."""
    cs = S @ centroids.T
    near = cs.max(axis=1)
    return {"centroid": _stats(near),
            "prototype": None if prototypes is None else _stats((S @ prototypes.T).max(axis=1)),
            "band_all_share": float((cs.min(axis=1) >= near - tau).mean()), "sigmas": DRIFT_SIGMAS,
            "window": WINDOW}


class DriftMonitor:
    """Rolling drift figures over the last ``window`` signatures of one routing artifact.

    ``centroids`` [K, d], ``prototypes`` [M, d] or None, ``stats``: the artifact's ``drift`` block (None for an
    artifact fitted before it: figures without a verdict)."""

    def __init__(self, centroids: np.ndarray, prototypes: np.ndarray | None, tau: float, stats: dict | None,
                 window: int | None = None):
        self.centroids = np.ascontiguousarray(centroids, dtype=np.float64)
        self.prototypes = None if prototypes is None else np.ascontiguousarray(prototypes, dtype=np.float64)
        self.tau = float(tau)
        self.stats = stats
        self.window = int(window or (stats or {}).get("window") or WINDOW)
        self._near: deque[float] = deque(maxlen=self.window)
        self._proto: deque[float] = deque(maxlen=self.window)
        self._all: deque[bool] = deque(maxlen=self.window)
        self.seen = 0

    @classmethod
    def for_model(cls, model: Any, stats: dict | None, window: int | None = None) -> "DriftMonitor":
        """For a :class:`eldr_cli.routing.RoutingModel` and its artifact's ``drift`` block."""
        protos = model.live[0] if model.live is not None else None
        return cls(model.centroids, protos, model.tau, stats, window)

    def observe(self, signature: np.ndarray) -> None:
        """One request's unit signature [d] (all zeros: no expert in the kept layers, not counted)."""
        s = np.asarray(signature, dtype=np.float64)
        if not s.any():
            return
        cs = self.centroids @ s
        top = float(cs.max())
        self._near.append(top)
        self._all.append(bool(cs.min() >= top - self.tau))
        if self.prototypes is not None:
            self._proto.append(float((self.prototypes @ s).max()))
        self.seen += 1

    def observe_many(self, S: np.ndarray) -> None:
        for s in np.asarray(S):
            self.observe(s)

    def observe_batch(self, S: np.ndarray, unit: bool = True) -> None:
        """:meth:`observe_many` as matrix products (each similarity to within rounding): the centroids and
        prototypes are read once per batch, not once per signature. ``unit=False``: rows not normalized (Eq. 2's
        cells); each product is divided by its row's norm instead (one pass fewer over them)."""
        S = np.asarray(S, dtype=np.float64)
        if unit:
            keep = S.any(axis=1)
            scale = None
        else:
            norm = np.sqrt(np.einsum("ij,ij->i", S, S))
            keep = norm > 0
            scale = 1.0 / norm[keep][:, None]
        S = S[keep]
        if not len(S):
            return
        cs = S @ self.centroids.T
        if scale is not None:
            cs *= scale
        ps = None
        if self.prototypes is not None:
            ps = (S @ self.prototypes.T).max(axis=1)
            ps = ps if scale is None else ps * scale[:, 0]
        self._extend(cs, ps)

    def observe_cells(self, rows: list[np.ndarray], nearest: list[int]) -> None:
        """eldr-live's hand-offs: each row [d] (float64 Eq. 2 cells, not normalized) and the prototype its decision
        found nearest (the similarity to that one, not a search over all: the same prototype but where two are
        within float32 rounding of each other), read once by a compiled loop (``routing.compiled.drift_dots``);
        each similarity that of :meth:`observe_batch` to within rounding (the sums' order differs). A row of
        another length than the centroids', or a prototype this artifact does not have, is not counted."""
        from eldr_cli.routing.compiled import drift_dots

        K = len(self.centroids)
        out = np.empty((len(rows), K + 2))
        none = np.empty(0)
        M = 0 if self.prototypes is None else len(self.prototypes)
        for i, (row, m) in enumerate(zip(rows, nearest, strict=True)):
            if self.prototypes is not None and not 0 <= m < M:
                out[i, 0] = 0.0  # a prototype of another artifact: not counted
                continue
            drift_dots(row, self.centroids, none if self.prototypes is None else self.prototypes[m], out[i])
        norm = np.sqrt(out[:, 0])
        keep = norm > 0
        if not keep.any():
            return
        scale = 1.0 / norm[keep]
        out = out[keep]
        self._extend(out[:, 1:K + 1] * scale[:, None], None if self.prototypes is None else out[:, K + 1] * scale)

    def _extend(self, cs: np.ndarray, ps: np.ndarray | None) -> None:
        """The window's new rows: their similarities to the centroids [n, K] and to their prototype [n] (or None)."""
        top = cs.max(axis=1)
        self._near.extend(top.tolist())
        self._all.extend((cs.min(axis=1) >= top - self.tau).tolist())
        if ps is not None:
            self._proto.extend(ps.tolist())
        self.seen += len(cs)

    def snapshot(self) -> dict[str, Any]:
        """Rolling means, the calibration's, thresholds and the verdict: ``drifted`` is None until a full
        window was seen (or without calibration figures), else whether a mean fell below its threshold."""
        n = len(self._near)
        out: dict[str, Any] = {"window": self.window, "requests": n, "seen": self.seen,
                               "centroid_similarity": float(np.mean(self._near)) if n else None,
                               "prototype_similarity": float(np.mean(self._proto)) if self._proto else None,
                               "band_all_share": float(np.mean(self._all)) if n else None,
                               "drifted": None, "reasons": []}
        st = self.stats
        if st is None:
            out["reasons"] = ["the routing artifact has no calibration drift figures (refit it)"]
            return out
        out["calibration"] = {k: (None if st.get(k) is None else {x: st[k][x] for x in ("mean", "std", "threshold")})
                              for k in ("centroid", "prototype")} | {"band_all_share": st.get("band_all_share")}
        if n < self.window:
            return out
        reasons = []
        for key, val in (("centroid", out["centroid_similarity"]), ("prototype", out["prototype_similarity"])):
            ref = st.get(key)
            if ref is not None and val is not None and val < ref["threshold"]:
                reasons.append(f"mean similarity to the nearest {key} {val:.3f} is below {ref['threshold']:.3f} "
                               f"(calibration {ref['mean']:.3f} - {st.get('sigmas', DRIFT_SIGMAS):g} sd)")
        out["drifted"], out["reasons"] = bool(reasons), reasons
        return out
