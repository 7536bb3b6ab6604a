"""Learned per-layer signature weights (issue 35, item 4): beyond the paper's fixed rules (IDF, greedy mask).

The greedy mask keeps or drops a layer; some kept layers say more about a request's decode than others. With a
weight v_l on layer l's block of the signature, the pair cosine distance of Eq. 1 needs only per-layer pair
sums (``PairLayerCache``): dot = sum_l u_l dots_l, norms likewise, with u_l = v_l^2. Coordinate ascent over the
kept layers, each weight tried at x0.5 and x2, keeps a change only when it raises rho on half of the fixed pair
sample by more than ``MIN_GAIN``; the result is kept only if rho on the other half is not lower than with the
mask's plain weights (so the learned weights never lower rho on the calibration split; else all ones).
"""

from __future__ import annotations

import numpy as np

from eldr_cli.method.signature import PairLayerCache, _rank, spearman_to_target

STEPS = (0.5, 2.0)    # multipliers tried per layer and pass
PASSES = 2
MIN_GAIN = 1e-4       # a change must raise the fitting half's rho by more than this
U_RANGE = (1 / 16, 16.0)


def _centered_rank(t: np.ndarray) -> np.ndarray:
    r = _rank(np.asarray(t, dtype=np.float64))
    return r - r.mean()


def _rho(cache: PairLayerCache, u: np.ndarray, half: tuple[np.ndarray, ...], target: np.ndarray) -> float:
    """rho of the weights ``u`` on one half of the pairs; ``half``: the cache's (dots, ni, nj) of those pairs."""
    dots, ni, nj = half
    d = cache.distance(u @ dots, u @ ni, u @ nj)
    return float(spearman_to_target(d[None], target)[0])


def learn_layer_weights(cache: PairLayerCache, pattern_distance: np.ndarray,
                        mask: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """(v [L]: per-layer signature weights, 0 outside ``mask`` and 1 where nothing was learned; the rho of the
    mask's plain weights and of the learned ones on both halves of the pairs). ``pattern_distance`` [P]: the
    decode patterns' pair cosine distances (Eq. 1's target)."""
    L, P = cache.dots.shape
    fit, chk = np.arange(0, P, 2), np.arange(1, P, 2)
    t_fit, t_chk = _centered_rank(pattern_distance[fit]), _centered_rank(pattern_distance[chk])
    u = np.zeros(L)
    u[np.asarray(mask)] = 1.0
    # each half's per-layer pair sums gathered once (a column gather of [L, P / 2] costs more than the product)
    fit_half = tuple(x[:, fit] for x in (cache.dots, cache.ni, cache.nj))
    chk_half = tuple(x[:, chk] for x in (cache.dots, cache.ni, cache.nj))
    base = {"fit": _rho(cache, u, fit_half, t_fit), "check": _rho(cache, u, chk_half, t_chk)}
    best = base["fit"]
    dots, ni, nj = fit_half
    cur = [u @ dots, u @ ni, u @ nj]
    for _ in range(PASSES):
        changed = False
        for layer in np.asarray(mask).tolist():
            cands = [g for g in STEPS if U_RANGE[0] <= u[layer] * g <= U_RANGE[1]]
            if not cands:
                continue
            # only layer l's term changes: current sums + (g - 1) u_l x its per-layer sums
            step = [(g - 1) * u[layer] for g in cands]
            d = np.stack([cache.distance(cur[0] + s * dots[layer], cur[1] + s * ni[layer], cur[2] + s * nj[layer])
                          for s in step])
            rhos = spearman_to_target(d, t_fit)
            b = int(np.argmax(rhos))
            if rhos[b] > best + MIN_GAIN:
                g = cands[b]
                for c, x in zip(cur, (dots, ni, nj), strict=True):
                    c += (g - 1) * u[layer] * x[layer]
                u[layer] *= g
                best, changed = float(rhos[b]), True
        if not changed:
            break
    learned = {"fit": best, "check": _rho(cache, u, chk_half, t_chk)}
    if learned["check"] < base["check"]:  # did not carry over to the other half: the mask's plain weights
        u = (u > 0).astype(np.float64)
        learned = dict(base)
    v = np.sqrt(u)
    return v, {"rho_plain_fit_half": base["fit"], "rho_plain_check_half": base["check"],
               "rho_learned_fit_half": learned["fit"], "rho_learned_check_half": learned["check"]}
