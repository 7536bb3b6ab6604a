"""How well eldr-live's decode-activation predictors predict, measured where they are fitted (issue 35).

The calibration rows with decode steps are split once (seeded): a quarter (at most 128) is held back. Every candidate is
built from the other rows only (prototype means without the held-back rows; shrinkage tuned on the rest by
leave-one-out) and scored on the held-back rows against their true per-step activation y_r(l, e):

- ``brier``: mean over (request, layer, expert) of (a - y)^2;
- ``log_loss``: the per-step log-loss -[y log a + (1 - y) log(1 - a)], a read as at least 1e-4;
- ``union_err_pct_b{8,32,64}``: mean |U(a) - U(y)| / U(y) over 48 random batches of b held-back requests,
  where U is the expected number of distinct experts a step of the batch activates,
  sum_{l,e} (1 - prod_r (1 - a_r(l, e))): what eldr-live's cost rests on. The clairvoyant (a = y) scores 0.

Candidates: ``prototype`` (the nearest prototype's mean: eldr-live before issue 35), ``shrinkage-global`` (one
kappa, w), ``shrinkage`` (per layer), and two ablations that are not served: ``own`` (the request's own prefill
distribution alone, kappa 0, w 1) and ``knn-8`` (the mean activation of the 8 nearest held-in requests by
signature: a matrix product over the calibration set per decision, too slow for the decision budget).
:func:`choose` keeps the simplest servable candidate within ``TOLERANCE`` of the best one's Brier score.
"""

from __future__ import annotations

import numpy as np

from eldr_cli.method.shrinkage import (
    LOSS_FLOOR,
    MAX_ACTIVATION,
    loo_prototype_means,
    prototype_sums,
    shrink,
    tune_both,
    tune_rows,
)
from eldr_cli.method.signature import rank_pool

SERVABLE = ("prototype", "shrinkage-global", "shrinkage")  # in order of simplicity
HOLD_BACK = 0.25
BATCHES = (8, 32, 64)
N_BATCHES = 48
TOLERANCE = 0.005  # a more complex predictor must beat the simpler one by more than 0.5% of its Brier score
MAX_HELD = 128  # held-back rows at most (the measurement's cost stays bounded at large N)


def _log_idle(a: np.ndarray) -> np.ndarray:
    """log(1 - a) [R, L * E] (float32) of activations [R, L, E] or [R, L * E]; a read as at most 1 - 1e-7."""
    q = np.clip(np.asarray(a.reshape(len(a), -1), dtype=np.float64), 0.0, 1.0 - 1e-7)
    return np.log1p(np.negative(q, out=q), out=q).astype(np.float32)


def _membership(batches: np.ndarray, n_rows: int) -> np.ndarray:
    """[n_batches, n_rows]: how often each row is in each batch."""
    member = np.zeros((len(batches), n_rows), dtype=np.float32)
    np.add.at(member, (np.repeat(np.arange(len(batches)), batches.shape[1]), batches.reshape(-1)), 1.0)
    return member


def _union(log_idle: np.ndarray, member: np.ndarray) -> np.ndarray:
    """Expected distinct experts per step of each batch [n_batches]: a batch's log q is the sum of its members'
    log(1 - a), one matrix product of the batches' membership counts with the rows' log(1 - a)."""
    return (1.0 - np.exp(member @ log_idle)).sum(axis=1, dtype=np.float64)


class HeldBack:
    """What every candidate is scored against, computed once: the held-back rows' true activations ``y`` [R, L, E]
    (as float64 [R, L * E], and 1 - y), and per batch size its rows' membership counts and true unions."""

    def __init__(self, y: np.ndarray, batches: dict[int, np.ndarray]):
        self.y = y.reshape(len(y), -1).astype(np.float64)
        self.not_y = 1 - self.y
        self.member = {b: _membership(idx, len(y)) for b, idx in batches.items()}
        log_idle = _log_idle(self.y)
        self.truth = {b: _union(log_idle, m) for b, m in self.member.items()}


def scores(a: np.ndarray, held: HeldBack) -> dict[str, float]:
    """The metrics of predictions ``a`` [R, L, E] against the held-back truth."""
    a2 = a.reshape(len(a), -1).astype(np.float64)
    p = np.clip(a2, LOSS_FLOOR, MAX_ACTIVATION)
    brier = np.subtract(a2, held.y)
    loss = np.log(p)
    loss *= held.y
    idle = np.log1p(np.negative(p, out=p), out=p)  # log(1 - p)
    idle *= held.not_y
    loss += idle
    out = {"brier": float(np.square(brier, out=brier).mean()), "log_loss": float(np.negative(loss, out=loss).mean())}
    la = _log_idle(a2)
    for b, member in held.member.items():
        ut = held.truth[b]
        out[f"union_err_pct_b{b}"] = float(100 * np.mean(np.abs(_union(la, member) - ut) / np.maximum(ut, 1e-9)))
    return out


def _knn(S: np.ndarray, y: np.ndarray, held: np.ndarray, rest: np.ndarray, k: int = 8) -> np.ndarray:
    """The ablation knn-k: each held-back row's mean true activation of its k nearest held-in rows by signature."""
    Su = S / np.maximum(np.linalg.norm(S, axis=1, keepdims=True), 1e-12)
    near = np.argsort(-(Su[held] @ Su[rest].T), axis=1)[:, :k]
    return y[rest[near]].mean(axis=1).astype(np.float32)


def _candidates(S, y, f, tok, labels, n_protos, held) -> dict[str, np.ndarray]:
    """Each candidate's predictions for the held-back rows, built from the other rows only (the knn ablation in
    the fit's second thread)."""
    rest = np.flatnonzero(~held)
    knn = rank_pool().submit(_knn, S, y, held, rest)
    y_rest, lab_rest = y[rest], labels[rest]
    sums = prototype_sums(y_rest, lab_rest, n_protos)
    n = np.bincount(lab_rest, minlength=n_protos)
    mean = y_rest.mean(axis=0)
    proto_means = np.where((n > 0)[:, None, None], sums / np.maximum(n, 1)[:, None, None], mean)
    proto = proto_means[labels[held]].astype(np.float32)
    sub = tune_rows(len(rest), 0)
    loo = loo_prototype_means(y_rest, lab_rest, n_protos, rows=sub, sums=sums)
    out = {"prototype": proto}
    fh, th = f[held], tok[held]
    tuned = tune_both(y_rest[sub], f[rest[sub]], tok[rest[sub]], loo)  # (global, per layer) from one pass
    for name, sh in zip(("shrinkage-global", "shrinkage"), tuned, strict=True):
        out[name] = shrink(fh, th, proto, sh.kappa, sh.weight)
    L = y.shape[1]
    out["own"] = shrink(fh, th, proto, np.zeros(L), np.ones(L))
    out["knn-8"] = knn.result()
    return out


def predictor_quality(S: np.ndarray, y: np.ndarray, f: np.ndarray, tok: np.ndarray, labels: np.ndarray,
                      n_protos: int, seed: int = 0) -> dict[str, dict[str, float]] | None:
    """{candidate: metrics} on the held-back split (None when there are too few rows to hold any back).

    ``S`` [R, d] signatures, ``y`` [R, L, E] true per-step activations (clipped to MAX_ACTIVATION), the prefill
    distribution ``f`` [R, L, E] and tokens ``tok`` [R, L] (:func:`prefill_frequency`) and the rows' prototype
    ``labels`` [R], all of the calibration rows with decode steps."""
    R = len(y)
    n_held = min(int(round(HOLD_BACK * R)), MAX_HELD)
    if n_held < 2 or R - n_held < 2:
        return None
    rng = np.random.default_rng(seed)
    held = np.zeros(R, dtype=bool)
    held[rng.choice(R, size=n_held, replace=False)] = True
    batches = {b: rng.integers(0, n_held, size=(N_BATCHES, b)) for b in BATCHES}
    yh = y[held]
    truth = HeldBack(yh, batches)
    cands = {**_candidates(S, y, f, tok, labels, n_protos, held), "clairvoyant": yh}
    # candidates scored in two threads (numpy releases the GIL; each score is computed as alone)
    return dict(zip(cands, rank_pool().map(lambda a: scores(a, truth), cands.values()), strict=True))


def choose(quality: dict[str, dict[str, float]] | None) -> str:
    """The simplest servable candidate whose held-back Brier score is within TOLERANCE of the best servable one
    (``prototype`` without a measurement)."""
    if not quality:
        return "prototype"
    best = min(quality[c]["brier"] for c in SERVABLE)
    return next(c for c in SERVABLE if quality[c]["brier"] <= best * (1 + TOLERANCE))

