"""The routing artifact in memory (:class:`RoutingModel`): what serving needs of a fit to turn a request's
handed-off prefill counts into its signature (Eq. 2) and compare it with the decoders' centroids."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError


def load_routing_artifact(path):
    """The ``routing`` artifact at ``path``; a ``fit`` directory is accepted (its ``routing`` sub-artifact).
    The one place a routing artifact is opened from a user's path."""
    from eldr_cli.artifacts.store import Artifact

    art = Artifact(path, kind=("routing", "fit"))
    if art.kind == "fit":
        art = Artifact(Path(path) / "routing", kind="routing")
    return art


_NO_CELLS32 = np.empty(0, dtype=np.float32)  # RoutingModel.cells: no float32 copy wanted


class RoutingModel:
    """Transform, per-cell weights [L, E], layer mask [N*], unit centroids [K, N* x E], tau."""

    def __init__(self, transform: str, weights: np.ndarray, mask: np.ndarray, centroids: np.ndarray,
                 tau: float = 0.1, domain_share: dict[str, float] | None = None,
                 live: tuple[np.ndarray, np.ndarray] | None = None,
                 live_shrinkage: tuple[np.ndarray, np.ndarray] | None = None, top_k: int = 1,
                 band_prior: float = 0.0):
        """``live``: (prototypes [M, N* x E], decode activation [M + 1, L, E]) of the eldr-live policy
        (:class:`eldr_cli.method.live.DecodeActivation`); None for artifacts fitted before it.
        ``live_shrinkage``: its per-layer (kappa [L], weight [L]) toward the request's own prefill distribution
        (None: the prototype's mean alone, as in artifacts fitted before issue 35); ``top_k``: the model's;
        ``band_prior``: the weight of eldr-live's band prior (``routing.live.band_prior_weight``; 0: none, as in
        artifacts fitted before it)."""
        from eldr_cli.method.signature import SERVABLE_TRANSFORMS

        if transform not in SERVABLE_TRANSFORMS:
            raise EldrError(f"routing artifact uses transform {transform!r}, which cannot be computed from "
                            f"handed-off counts; refit with one of {', '.join(SERVABLE_TRANSFORMS)}")
        self.transform = transform
        self.weights = np.asarray(weights, dtype=np.float64)
        self.mask = np.asarray(mask, dtype=np.int64)
        self.centroids = np.ascontiguousarray(centroids, dtype=np.float64)
        self.tau = float(tau)
        self.domain_share = dict(domain_share or {})
        self.live = None if live is None else (np.ascontiguousarray(live[0], dtype=np.float64),
                                               np.ascontiguousarray(live[1], dtype=np.float32))
        self.live_shrinkage = None if live_shrinkage is None else (np.asarray(live_shrinkage[0], dtype=np.float64),
                                                                   np.asarray(live_shrinkage[1], dtype=np.float64))
        self.top_k = int(top_k)
        self.band_prior = float(band_prior)
        self._kept_weights = self.weights[self.mask]  # [N*, E]: what signatures() indexes on every call

    @property
    def n_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        L, E = self.weights.shape
        return int(L), int(E)

    @classmethod
    def load(cls, path) -> "RoutingModel":
        art = load_routing_artifact(path)
        p = art.params
        live = (art.array("live_prototypes"), art.array("live_activation")) if p.get("live_prototypes") else None
        shrink = (art.array("live_kappa"), art.array("live_weight")) \
            if live is not None and p.get("live_predictor") not in (None, "prototype") else None
        return cls(p["transform"], art.array("weights"), art.array("mask"), art.array("centroids"),
                   tau=p["tau"], domain_share=p.get("domain_share"), live=live, live_shrinkage=shrink,
                   top_k=int(p.get("top_k") or 1), band_prior=float(p.get("band_prior") or 0.0))

    def signature(self, counts: np.ndarray, unit: bool = True) -> np.ndarray:
        """Eq. 2 on one request's counts [L, E] -> unit signature [N* x E] (zeros if empty): the fit's own
        :func:`eldr_cli.method.signature.signatures`, so fit and serving cannot disagree (``unit=False``:
        not normalized, the same direction)."""
        from eldr_cli.method.signature import l2_normalize

        c = np.asarray(counts)
        self.check_shape(c)
        x = self._cells(c)
        return l2_normalize(x.reshape(1, -1))[0] if unit else x

    def check_shape(self, c: np.ndarray) -> None:
        """Refuse counts of another shape than the artifact's [L, E] (EldrError)."""
        if c.shape != self.weights.shape:
            raise EldrError(f"signature has shape {c.shape}, the routing artifact expects {self.weights.shape}")

    def signatures(self, counts: list[np.ndarray], unit: bool = True) -> np.ndarray:
        """:meth:`signature` of each of ``counts`` (each [L, E], checked by the caller) as rows [n, N* x E], the same
        float operations; only the kept layers are read."""
        from eldr_cli.method.signature import l2_normalize

        x = np.empty((len(counts), self._kept_weights.size))
        for i, c in enumerate(counts):
            x[i] = self._cells(np.asarray(c))
        return l2_normalize(x) if unit else x

    def _cells(self, c: np.ndarray) -> np.ndarray:
        """Eq. 2's weighted cells of the kept layers, flat [N* x E] float64: one compiled pass
        (:func:`eldr_cli.routing.compiled.eq2_row`, bit-identical to ``method.signature.weighted_cells``) for
        numeric counts, else ``weighted_cells`` itself."""
        if c.dtype.kind in "iuf":
            return self.cells(c)[0]
        from eldr_cli.method.signature import weighted_cells

        return weighted_cells(c[self.mask], self.transform, self._kept_weights).reshape(-1)

    @property
    def eq2_args(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(kept layers [N*], their weights [N*, E], the transform's code): Eq. 2's arguments to the compiled loops
        (:mod:`eldr_cli.routing.compiled`)."""
        from eldr_cli.routing.compiled import TRANSFORM_CODE

        return self.mask, self._kept_weights, TRANSFORM_CODE[self.transform]

    def cells(self, c: np.ndarray, out32: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """Eq. 2's cells of numeric counts ``c`` [L, E] (shape checked by the caller) as :meth:`_cells` gives them,
        and whether one is not zero; ``out32`` (float32 [N* x E]): also filled with them rounded to float32 (the
        request path's one pass: eldr-live's nearest prototype reads them)."""
        from eldr_cli.routing.compiled import eq2_row

        out = np.empty(self._kept_weights.size)
        nonzero = eq2_row(c, *self.eq2_args, out, _NO_CELLS32 if out32 is None else out32)
        return out, bool(nonzero)
