"""The request path's per-request array work as compiled loops (numba): Eq. 2 of one request's counts and
eldr-live's shrunk decode activation (issue 36 item 7: eldr-live's hand-off CPU).

Each numpy expression they replace was a dozen small ufunc calls over [L, E] (a pass over memory and ~1 us of
call overhead each); a loop does it in one or two passes. Each output element is the same IEEE operations,
in the same order and the same precision, as the numpy code it replaces (no fused multiply-add: numba leaves
floating-point contraction off without ``fastmath``), so the values are bit-identical:

- :func:`eq2_row`: ``weighted_cells(counts[mask], transform, weights)`` of :mod:`eldr_cli.method.signature`
  (``float64(c) * w``, ``sqrt(float64(c)) * w`` or ``float64(c > 0) * w``; square roots are correctly rounded);
- :func:`shrunk_activation`: ``PrefillPredictor``'s ``a = (1 - lam) A_m + (lam / T) c`` clipped at
  ``MAX_ACTIVATION``, in float32, and ``-a`` (the caller takes numpy's ``log1p`` of it: the transcendental
  stays numpy's). The per-layer token counts T are summed exactly on integers; numpy's float32 sum of the
  same integers is exact too while every layer's total is below 2**24, and where one is not the loop declines
  (returns False) and the caller keeps the numpy form.

``tests/test_live_predictor.py`` checks both against their numpy forms bit for bit on random counts.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from eldr_cli.costmodel import StepTerms, step_ms_from_terms

# method.signature.SERVABLE_TRANSFORMS -> the loop's branch (count-idf's IDF is folded into the weights)
TRANSFORM_CODE = {"count": 0, "count-idf": 0, "sqrt": 1, "binary": 2}
_KT = StepTerms._fields.index("kt")  # the terms array is StepTerms in field order (a constant to the compiled loop)
EXACT_F32 = 1 << 24  # integers below this are exact in float32, and so is every partial sum below it


def _compiled(fn):
    """``njit`` with numba's on-disk cache (beside this file, else the user's cache directory); where neither is
    writable, compiled in each process."""
    try:
        return njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(fn)


@_compiled
def eq2_row(counts, mask, weights, code, out, out32):  # pragma: no cover - compiled
    """Eq. 2's cells of one request: ``out`` [N* x E] float64 <- counts [L, E] at the kept layers ``mask`` [N*],
    transformed (``code``: TRANSFORM_CODE) and weighted by ``weights`` [N*, E] float64; ``out32`` (float32, the
    same length, or empty: not written) <- the same cells rounded to float32 (``out.astype(np.float32)``). True
    when a cell is not zero (``out.any()``). One row of E cells at a time: loops the compiler vectorizes."""
    E = counts.shape[1]
    wide = out32.shape[0] > 0
    nonzero = False
    for i in range(mask.shape[0]):
        src = counts[mask[i]]
        w = weights[i]
        o = out[i * E:(i + 1) * E]
        for e in range(E):
            x = float(src[e])
            if code == 1:
                x = math.sqrt(x)
            elif code == 2:
                x = 1.0 if x > 0.0 else 0.0
            o[e] = x * w[e]
        for e in range(E):
            nonzero |= o[e] != 0.0
        if wide:
            o32 = out32[i * E:(i + 1) * E]
            for e in range(E):
                o32[e] = np.float32(o[e])
    return nonzero


@_compiled
def shrunk_activation(counts, act, w, kappa, inv_k, a_max, a, neg_a):  # pragma: no cover - compiled
    """``a`` [L*E] float32 <- min((1 - lam) act + (lam / T) c, a_max) per layer, with T = sum_e c * inv_k and
    lam = w T / max(T + kappa, 1e-9); ``neg_a`` <- -a. ``counts`` int [L, E], ``act`` float32 [L, E], ``w``,
    ``kappa`` float32 [L]. False (outputs unspecified) when a layer's |counts| sum reaches 2**24. One layer's E
    cells at a time: loops the compiler vectorizes."""
    L, E = counts.shape
    one = np.float32(1.0)
    eps = np.float32(1e-9)
    for row in range(L):
        c = counts[row]
        s = 0
        s_abs = 0
        for e in range(E):
            s += c[e]
            s_abs += abs(c[e])
        if s_abs >= EXACT_F32:
            return False
        tok = np.float32(s) * inv_k
        den = tok + kappa[row]
        lam = (w[row] * tok) / (eps if den < eps else den)  # np.maximum (a NaN stays NaN)
        keep = one - lam
        per = lam / (eps if tok < eps else tok)
        m = act[row]
        o = a[row * E:(row + 1) * E]
        n = neg_a[row * E:(row + 1) * E]
        for e in range(E):
            v = m[e] * keep + np.float32(c[e]) * per
            if v > a_max:  # np.minimum (a NaN stays NaN)
                v = a_max
            o[e] = v
            n[e] = -v
    return True


_step = _compiled(step_ms_from_terms)  # the one step formula, compiled (as the simulator's step_time)


@_compiled
def live_costs(terms, loads, active, ctx, added, c_new, cost, growth):  # pragma: no cover - compiled
    """eldr-live's per-decoder cost and its growth per unseen request (``EldrLivePolicy._choose``'s rule) into
    ``cost``, ``growth`` [K] float64, from ``terms`` (the 8 step terms, float64), ``loads`` [K] int, ``active``,
    ``ctx`` [K] float64 (A_d, C_d), ``added`` [K] float64 (dA_d) and the request's context tokens ``c_new``:
    T = step(A, B, C) (0 when idle), T1 = step(A + dA, B + 1, C + c_new), cost = T1 + B (T1 - T),
    growth = T1 - step(A, B, C) + kt; the same double operations in the same order as on Python floats."""
    kt = terms[_KT]
    for k in range(loads.shape[0]):
        b = float(loads[k])
        tb = _step(terms, active[k], b, ctx[k])
        t = tb if b > 0 else 0.0
        t1 = _step(terms, active[k] + added[k], b + 1, ctx[k] + c_new)
        cost[k] = t1 + b * (t1 - t)
        growth[k] = t1 - tb + kt


def warm(widths=(np.int64,)) -> None:
    """Load (or compile) the loops for counts [L, E] of the integer ``widths`` now, not on the first request:
    loading takes a fraction of a second, compiling a few per width (once per machine, then cached). The proxy's
    hand-off warms the wire's widths (``handoff.WIRE_DTYPES``) as well."""
    a = np.empty(2, dtype=np.float32)
    f = np.ones(1, dtype=np.float32)
    for dt in widths:
        c = np.zeros((1, 2), dtype=dt)
        eq2_row(c, np.zeros(1, dtype=np.int64), np.ones((1, 2)), 0, np.empty(2), a)
        shrunk_activation(c, np.zeros((1, 2), dtype=np.float32), f, f, np.float32(1.0), np.float32(0.5), a, a.copy())
    z = np.zeros(1)
    live_costs(np.zeros(8), np.zeros(1, dtype=np.int64), z, z, z, 0, z.copy(), z.copy())
