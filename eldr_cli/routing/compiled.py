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

- :func:`live_entry`: eldr-live's whole entry of one request in one call (the two above and the nearest prototype
  by :func:`nearest_certain`, which answers only where BLAS's float32 product must give the same row, by a
  rounding-error bound, and otherwise leaves it to BLAS).

``tests/test_live_predictor.py`` checks them against their numpy forms bit for bit on random counts.

Off the request path, :func:`drift_dots` gives the drift watch's similarities of one request's cells in one pass
over them (to within rounding of BLAS's: ``tests/test_drift.py``).
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


def _compiled(fn=None, **options):
    """``njit`` (with ``options``) and numba's on-disk cache (beside this file, else the user's cache directory);
    where neither is writable, compiled in each process. ``@_compiled`` or ``@_compiled(fastmath=...)``."""
    if fn is None:
        return lambda f: _compiled(f, **options)
    try:
        return njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(**options)(fn)


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


@_compiled(fastmath={"reassoc", "contract"})  # sums whose error is bounded whatever their order
def _dots(protos, v, out, size, signed):  # pragma: no cover - compiled
    """``out[m]`` <- sum_j protos[m, j] v[j] and ``size[m]`` <- sum_j |protos[m, j] v[j]| in float64, for float32
    ``protos`` and ``v`` as float64 (a product of two float32 values is exact in float64; the sums in whatever order
    the compiler vectorizes them). Without ``signed`` (no term is negative) the size is the sum itself."""
    for m in range(protos.shape[0]):
        p = protos[m]
        acc = 0.0
        if signed:
            tot = 0.0
            for j in range(p.shape[0]):
                x = p[j] * v[j]
                acc += x
                tot += abs(x)
            size[m] = tot
        else:
            for j in range(p.shape[0]):
                acc += p[j] * v[j]
            size[m] = acc
        out[m] = acc


@_compiled
def nearest_certain(protos, v32, protos_signed):  # pragma: no cover - compiled
    """The row of ``protos`` [M, d] (float32) whose product with ``v32`` [d] (float32) is the largest *in numpy's
    float32 product* (``int((protos @ v32).argmax())``, BLAS), where that is certain without computing it; else -1.
    ``protos_signed``: whether a prototype has a negative element.

    Any float32 evaluation of a dot product of n terms (BLAS's, in any order, with or without fused multiply-adds)
    is within gamma_n S of the exact value, gamma_n = n u / (1 - n u) with u = 2^-24 and S the sum of the terms'
    magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1). The exact values and
    S are computed here in float64, to within n 2^-53 S. Where the best row's value exceeds every other row's by
    more than twice both rows' bounds together, 2 (gamma_n + 2 n 2^-53) (S_best + S_m), the float32 product's
    largest element is that row's and no other's: BLAS's answer, without BLAS. Otherwise (or on a NaN) -1."""
    M, d = protos.shape
    v = np.empty(d)
    signed = protos_signed
    for j in range(d):
        v[j] = v32[j]
        signed |= v32[j] < 0
    dots = np.empty(M)
    size = np.empty(M)
    _dots(protos, v, dots, size, signed)
    best = 0
    for m in range(1, M):
        if dots[m] > dots[best]:
            best = m
    n = d + 2.0
    u32 = 2.0 ** -24
    g = 2.0 * (n * u32 / (1.0 - n * u32) + 2.0 * n * 2.0 ** -53)
    for m in range(M):
        if m != best and not (dots[best] - dots[m] > g * (size[best] + size[m])):
            return -1
    return best


@_compiled
def live_entry(counts, mask, weights, code, protos, protos_signed, act, w, kappa, inv_k, a_max,
               shrink):  # pragma: no cover - compiled
    """eldr-live's entry of one request's integer counts in one call: Eq. 2's cells (:func:`eq2_row`), the nearest
    prototype (:func:`nearest_certain`) and, with ``shrink``, the activation shrunk toward that prototype's mean
    ``act[m]`` (:func:`shrunk_activation`) -> (status, m, cells [N* x E] float64, a [L*E] float32, -a).

    status 0: every cell is zero (the caller takes the mean request); 1: done; 2: the nearest prototype too close
    to call without BLAS (the cells are set: the caller finds it and shrinks); 3: the shrinkage declined (a
    layer's counts reach 2**24; ``m`` and the cells are set: the caller shrinks in numpy)."""
    d = mask.shape[0] * counts.shape[1]
    sig = np.empty(d)
    sig32 = np.empty(d, dtype=np.float32)
    n_out = counts.size if shrink else 0
    a = np.empty(n_out, dtype=np.float32)
    neg_a = np.empty(n_out, dtype=np.float32)
    if not eq2_row(counts, mask, weights, code, sig, sig32):
        return 0, -1, sig, a, neg_a
    m = nearest_certain(protos, sig32, protos_signed)
    if m < 0:
        return 2, -1, sig, a, neg_a
    if shrink and not shrunk_activation(counts, act[m], w, kappa, inv_k, a_max, a, neg_a):
        return 3, m, sig, a, neg_a
    return 1, m, sig, a, neg_a


@_compiled(fastmath={"reassoc", "contract"})  # the drift watch's figures are similarities to within rounding
def drift_dots(cells, centroids, proto, out):  # pragma: no cover - compiled
    """The drift watch's products of one request's Eq. 2 cells [d] (float64), in one pass over them:
    ``out[0]`` <- |cells|^2, ``out[1 + k]`` <- cells . centroids[k] for the K rows of ``centroids`` [K, d],
    ``out[K + 1]`` <- cells . proto (``proto`` [d], the prototype eldr-live's decision found nearest; empty: not
    computed). float64 sums in whatever order the compiler vectorizes them (``DriftMonitor.observe_cells``).
    Cells of another length than the centroids' or the prototype's (an artifact reloaded under the same path):
    ``out[0]`` <- 0 (not counted), nothing read."""
    K = centroids.shape[0]
    if cells.shape[0] != centroids.shape[1] or 0 < proto.shape[0] != cells.shape[0]:
        out[0] = 0.0
        return
    sq = 0.0
    for j in range(cells.shape[0]):
        sq += cells[j] * cells[j]
    out[0] = sq
    for k in range(K):
        c = centroids[k]
        acc = 0.0
        for j in range(cells.shape[0]):
            acc += cells[j] * c[j]
        out[1 + k] = acc
    if proto.shape[0] > 0:
        acc = 0.0
        for j in range(cells.shape[0]):
            acc += cells[j] * proto[j]
        out[K + 1] = acc


@_compiled(fastmath={"reassoc", "contract"})  # a prior, not a bit-exact figure: vectorized float32 sums
def band_prior_of(cells, centroids, scale, out):  # pragma: no cover - compiled
    """eldr-live's band prior of one request's Eq. 2 cells [d] (float64) into ``out`` [K] (float64):
    ``1 + scale * (max_j s_j - s_k)``, ``s_k`` the cells' cosine to ``centroids[k]`` (unit rows [K, d], float32: the
    products in float32, twice as many per vector; a prior, not a decision's arithmetic) and ``scale`` the prior's
    weight over tau (``routing.live``). False, ``out`` untouched, for zero cells or cells of another length."""
    K, d = centroids.shape
    if cells.shape[0] != d:
        return False
    v = np.empty(d, dtype=np.float32)
    sq = 0.0
    for j in range(d):
        v[j] = np.float32(cells[j])
        sq += cells[j] * cells[j]
    if sq == 0.0:
        return False
    best = -np.inf
    for k in range(K):
        acc = np.float32(0.0)
        for j in range(d):
            acc += v[j] * centroids[k, j]
        out[k] = acc
        best = max(best, out[k])
    inv = scale / np.sqrt(sq)
    for k in range(K):
        out[k] = 1.0 + inv * (best - out[k])
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


@_compiled
def live_choice(terms, loads, active, ctx, added, c_new):  # pragma: no cover - compiled
    """:func:`live_costs` into new arrays -> (cost, growth) [K] float64 (one call from Python, no allocations there)."""
    cost = np.empty(loads.shape[0])
    growth = np.empty(loads.shape[0])
    live_costs(terms, loads, active, ctx, added, c_new, cost, growth)
    return cost, growth


def warm(widths=(np.int64,), read_only: bool = False) -> None:
    """Load (or compile) the loops for counts [L, E] of the integer ``widths`` now, not on the first request:
    loading takes a fraction of a second, compiling a few per width (once per machine, then cached). The proxy's
    hand-off warms the wire's widths (``handoff.WIRE_DTYPES``) with ``read_only`` too: its counts are a read-only
    view of the inflated bytes (a separate compilation)."""
    a = np.empty(2, dtype=np.float32)
    f = np.ones(1, dtype=np.float32)
    for dt in widths:
        for writable in (True, False) if read_only else (True,):
            c = np.zeros((1, 2), dtype=dt)
            c.setflags(write=writable)
            eq2_row(c, np.zeros(1, dtype=np.int64), np.ones((1, 2)), 0, np.empty(2), a)  # RoutingModel.cells
            live_entry(c, np.zeros(1, dtype=np.int64), np.ones((1, 2)), 0, np.ones((1, 2), dtype=np.float32), False,
                       np.zeros((1, 1, 2), dtype=np.float32), f, f, np.float32(1.0), np.float32(0.5), True)
    z = np.zeros(1)
    live_choice(np.zeros(8), np.zeros(1, dtype=np.int64), z, z, np.zeros(1, dtype=np.float32), 0)
    band_prior_of(np.ones(2), np.ones((1, 2), dtype=np.float32), 1.0, np.empty(1))


def warm_drift() -> None:
    """Load (or compile) the drift watch's loop (:func:`drift_dots`): by the watch's own thread as it starts, not by
    every eldr-live predictor's :func:`warm` (reports and simulations have no drift watch)."""
    drift_dots(np.zeros(2), np.zeros((1, 2)), np.zeros(2), np.empty(3))
