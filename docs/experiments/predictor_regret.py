"""What eldr-live's predictor candidates cost in decisions, not only in error (issue 35), on one trace's calibration.

An experiment, not part of eldr. It refits the trace (``eldr fit``'s code, into a temporary directory) and keeps
the inputs of the fit's held-back measurement (``method.live_quality``: the same split, the same candidates),
adds the issue's third candidate, a ridge map from the request's L x E prefill distribution to its decode
activation (closed form, fitted on the held-in rows), and the served shrinkage sharpened or flattened, and
scores each candidate by *decision regret*: 8 decoders, each running a batch of b held-in requests with their
true activations; a held-back request goes where its predicted growth of the expected distinct experts
sum_{l,e} a_r(l, e) q_d(l, e) is least; regret is the true growth there minus the least true growth, over the
mean true growth minus the least (0: the clairvoyant's pick; about 1: a random decoder). 400 draws per batch
size. docs/routing.md quotes its output on the demo's trace:

    python docs/experiments/predictor_regret.py artifacts/demo/trace --decoders 8
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import eldr_cli.method.live as live
from eldr_cli.method import live_quality as q
from eldr_cli.pipeline.fit import run_fit


def captured_inputs(trace: Path, decoders: int) -> tuple:
    """(S, y, f, tok, labels, M, seed): what ``eldr fit`` hands its held-back measurement on this trace."""
    got: dict = {}
    orig = live.predictor_quality

    def keep(*a, **k):
        got["args"] = (*a, k.get("seed", 0))
        return orig(*a, **k)

    live.predictor_quality = keep
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_fit(trace, Path(tmp) / "fit", decoders=decoders, pairs=5000, seed=0, figures=False)
    finally:
        live.predictor_quality = orig
    if "args" not in got:
        raise SystemExit("the trace's calibration rows have no decode steps: no predictor is fitted")
    return got["args"]


def regret(y_in: np.ndarray, y_out: np.ndarray, pred: np.ndarray, b: int, draws: int = 400) -> float:
    g = np.random.default_rng(1)
    out = []
    for _ in range(draws):
        i = g.integers(len(y_out))
        qd = np.exp(np.log1p(-np.clip(y_in[g.integers(0, len(y_in), size=(8, b))], 0, 0.999)).sum(axis=1))
        true, guess = qd @ y_out[i], qd @ pred[i]
        best = true.min()
        out.append((true[int(np.argmin(guess))] - best) / max(true.mean() - best, 1e-12))
    return float(np.mean(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--decoders", type=int, default=8)
    a = ap.parse_args(argv)
    S, y, f, tok, labels, M, seed = captured_inputs(a.trace, a.decoders)
    R, L, E = y.shape
    n_held = min(int(round(q.HOLD_BACK * R)), q.MAX_HELD)  # the split of live_quality.predictor_quality
    rng = np.random.default_rng(seed)
    held = np.zeros(R, dtype=bool)
    held[rng.choice(R, size=n_held, replace=False)] = True
    truth = q.HeldBack(y[held], {b: rng.integers(0, n_held, size=(q.N_BATCHES, b)) for b in q.BATCHES})
    cands = q._candidates(S, y, f, tok, labels, M, held)
    rest, hi = np.flatnonzero(~held), np.flatnonzero(held)
    X, Y = f.reshape(R, -1).astype(np.float64), y.reshape(R, -1).astype(np.float64)
    mx, my = X[rest].mean(axis=0), Y[rest].mean(axis=0)
    A, B = X[rest] - mx, Y[rest] - my
    for lam in (0.1, 1.0, 10.0):
        W = np.linalg.solve(A.T @ A + lam * np.eye(A.shape[1]), A.T @ B)
        cands[f"ridge-{lam:g}"] = np.clip((X[hi] - mx) @ W + my, 0, 0.999).reshape(-1, L, E).astype(np.float32)
    shr = cands["shrinkage"].astype(np.float64)
    for gamma in (0.8, 1.1):  # log(1 - a) scaled: a flatter or sharper union
        cands[f"shr-gamma-{gamma:g}"] = 1 - np.exp(gamma * np.log1p(-np.clip(shr, 0, 0.999)))
    for p in (1.2, 1.5, 2.0):  # a^p, each layer renormalized to the same expected count
        sharp = np.power(np.clip(shr, 1e-9, 1), p)
        cands[f"shr-pow-{p:g}"] = np.clip(sharp / sharp.sum(-1, keepdims=True) * shr.sum(-1, keepdims=True), 0, 0.999)
    y_in, y_out = Y[rest], Y[hi]
    print(f"{R} calibration rows with decode steps, {n_held} held back; L x E = {L} x {E}")
    print(f"{'candidate':<17} {'Brier':>7} {'union% b8/b32/b64':>18}  regret b=2/4/8/16")
    for name, p in cands.items():
        s = q.scores(p, truth)
        u = "/".join(f"{s[f'union_err_pct_b{b}']:.1f}" for b in q.BATCHES)
        r = " ".join(f"{regret(y_in, y_out, p.reshape(len(p), -1).astype(np.float64), b):.3f}" for b in (2, 4, 8, 16))
        print(f"{name:<17} {s['brier']:7.4f} {u:>18}  {r}")


if __name__ == "__main__":
    main()
