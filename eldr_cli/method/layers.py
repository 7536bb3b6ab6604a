"""Transform choice and greedy layer selection on signature quality rho (ELDR §4.2.2 step 3, §4.2.3)."""

from __future__ import annotations

from functools import partial

import numpy as np

from eldr_cli.constraints import validate_parameter
from eldr_cli.errors import InvalidDataError
from eldr_cli.method.layer_weights import learn_layer_weights
from eldr_cli.method.signature import (
    SERVABLE_TRANSFORMS,
    TRANSFORMS,
    PairLayerCache,
    _rank,
    apply_transform,
    pair_cosine_distance_fast,
    pair_cosine_distance_transformed,
    rank_pool,
    sample_pairs,
    spearman_to_target,
)


class LayerSelector:
    """Scores transforms by rho on the full layer mask, then orders all L layers greedily.

    Parameters: ``transform`` ("auto" or one of TRANSFORMS), ``n_pairs`` (fixed-seed pair sample
    shared by every candidate), ``seed``.

    fit(prefill_counts [R,L,E], decode_counts [R,L,E], decode_steps [R], idf [L,E],
        gates={"gate-prob": [R,L,E], "gate-logit": [R,L,E]}) -> self with
    ``transform_``, ``rho_by_transform_`` {name: rho}, ``order_`` int [L], ``cumulative_rho_`` [L],
    ``n_layers_`` (N*), ``mask_`` int [N*] (sorted kept layers), ``weights_`` [L, E] (the transform's per-cell
    weights times ``layer_weights_`` [L], learned on rho unless ``learn_weights=False``; ``weight_rho_``: rho
    before and after on the two halves of the pairs).

    With ``transform="auto"`` the best servable transform (computable from handed-off counts) wins;
    gate transforms are scored for the report (Fig. 7) but cannot be served.
    """

    def __init__(self, transform: str = "auto", n_pairs: int = 20000, seed: int = 0, learn_weights: bool = True):
        self.transform = transform
        self.n_pairs = n_pairs
        self.seed = seed
        self.learn_weights = learn_weights

    def fit(self, prefill_counts, decode_counts, decode_steps, idf, gates: dict | None = None) -> "LayerSelector":
        validate_parameter("transform", self.transform)
        validate_parameter("n_pairs", self.n_pairs)
        gates = {k: v for k, v in (gates or {}).items() if v is not None}
        pc = np.asarray(prefill_counts)
        keep = (np.asarray(decode_steps) > 0) & (pc.reshape(pc.shape[0], -1).sum(axis=1) > 0)
        if keep.sum() < 2:
            raise InvalidDataError("layer selection needs at least 2 requests with both prefill and decode tokens")
        idx = slice(None) if keep.all() else np.flatnonzero(keep)
        R, L, E = pc.shape
        self.n_requests_ = int(keep.sum())
        self.pairs_ = sample_pairs(self.n_requests_, self.n_pairs, self.seed)
        # §4.2.1 decode pattern p = counts / steps; pair_cosine_distance_fast normalizes it
        steps = np.maximum(np.asarray(decode_steps)[idx], 1).astype(np.float32)
        pattern = np.asarray(decode_counts)[idx].astype(np.float32) / steps[:, None, None]
        pattern_distance = pair_cosine_distance_fast(pattern, self.pairs_)
        t = _rank(pattern_distance)
        t -= t.mean()
        self._target = t

        candidates = [n for n in TRANSFORMS if not n.startswith("gate") or n in gates]
        if self.transform != "auto":
            if self.transform.startswith("gate") and self.transform not in gates:
                raise InvalidDataError(f"transform {self.transform} needs {self.transform.replace('-', '_')} sums in "
                                       "the trace, which this trace lacks")
            candidates = [self.transform]
        self.rho_by_transform_ = {}
        srcs = {name: np.asarray(gates[name] if name.startswith("gate") else pc)[idx] for name in candidates}
        for name in candidates:
            # all layers: one flat signature per request, so pair dots need no per-layer split
            d = pair_cosine_distance_transformed(srcs[name], name, idf, self.pairs_)
            self.rho_by_transform_[name] = float(spearman_to_target(d, t)[0])
        if self.transform == "auto":
            servable = {k: v for k, v in self.rho_by_transform_.items() if k in SERVABLE_TRANSFORMS}
            self.transform_ = max(servable, key=lambda n: servable[n])
        else:
            self.transform_ = self.transform
        x = apply_transform(srcs[self.transform_], self.transform_, idf)
        cache = PairLayerCache(x, self.pairs_)
        self.order_, self.cumulative_rho_ = self._greedy(cache, t)
        self.n_layers_ = int(np.argmax(self.cumulative_rho_)) + 1
        self.mask_ = np.sort(self.order_[: self.n_layers_]).astype(np.int32)
        self.weights_ = np.asarray(idf, dtype=np.float64) if self.transform_ == "count-idf" else np.ones((L, E))
        self.layer_weights_ = np.ones(L)
        self.weight_rho_: dict[str, float] = {}
        if self.learn_weights:  # issue 35: per-layer weights learned on rho (method.layer_weights)
            v, self.weight_rho_ = learn_layer_weights(cache, pattern_distance, self.mask_)
            self.layer_weights_ = np.where(v > 0, v, 1.0)
            self.weights_ = self.weights_ * self.layer_weights_[:, None]
        self.rho_peak_ = float(self.cumulative_rho_[self.n_layers_ - 1])
        self.rho_all_layers_ = float(self.cumulative_rho_[-1])
        return self

    @staticmethod
    def _greedy(cache: PairLayerCache, target: np.ndarray):
        """§4.2.2 step 3: append the layer whose inclusion gives the highest rho; order all L.

        Candidates are compared with rho at 16-bit distance resolution (see signature._sorted_keys);
        the reported cumulative rho of each chosen prefix is recomputed at float32 resolution.
        """
        L = cache.dots.shape[0]
        chosen: list[int] = []
        rho_path: list[float] = []
        dot = np.zeros(cache.dots.shape[1])
        ni = np.zeros_like(dot)
        nj = np.zeros_like(dot)
        remaining = list(range(L))
        pool = rank_pool()
        while remaining:
            rem = np.asarray(remaining)
            # candidates' distances in two threads (numpy's ufuncs release the GIL); ranked together,
            # as the 16-bit keys are scaled by the largest distance of all candidates
            parts = [part for part in np.array_split(rem, 2) if len(part)]
            d = np.concatenate(list(pool.map(partial(cache.distances_adding, dot, ni, nj), parts)))
            rhos = spearman_to_target(d, target, resolution="u16")
            b = int(np.argmax(rhos))
            best = int(rem[b])
            chosen.append(best)
            rho_path.append(float(spearman_to_target(d[b:b + 1], target)[0]))
            dot += cache.dots[best]
            ni += cache.ni[best]
            nj += cache.nj[best]
            remaining.remove(best)
        return np.asarray(chosen, dtype=np.int32), np.asarray(rho_path)
