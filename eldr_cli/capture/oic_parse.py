"""The fast path of the trace import: one Orders-in-Chaos file parsed in a single compiled pass.

It accepts only what it can prove is the common layout and returns None for everything else, so the
JSON parser in ``import_trace`` decides those files; on what it accepts, it returns exactly what the
JSON path returns (the tests compare both on every shape and layout). The common layout is:

    [ {"<layer>": [[id, ...], ...] or null, ...},      element 0: prefill, one list of k ids per token
      {"<layer>": [[id, ...]] or null, ...}, ... ]     elements 1..N: one decode step each

with any JSON whitespace, any key order, layer keys and ids of at most 4 digits (no leading zeros),
every list of ids k long, every non-null prefill layer holding the same number of token lists, and
every decode step holding exactly one list for each of those layers (and nothing but ``null`` for
any other key). A byte-level state machine over the whole file costs well under a millisecond for a
350 KB file, where a JSON parse builds hundreds of thousands of Python objects first.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

_MAX_DIGITS = 4  # ids and layer keys below 10,000; longer numbers go to the JSON path
_OK, _FAIL = 0, 1
_NEXT, _CLOSE, _BAD = 0, 1, 2  # what follows an item (_separator)


def _compiled(**options):
    """``njit`` with numba's on-disk cache: compiling the parser takes seconds, loading it from the cache
    a fraction of one. numba keeps the cache beside this file or, where that is read-only, in the
    user's cache directory (or NUMBA_CACHE_DIR); if neither is writable, compile in each process."""
    def wrap(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(**options)(fn)
    return wrap


@_compiled(inline="always")
def _at(b, i):
    # a byte past the end reads as 0, which no rule accepts: bounds checks in one place
    return b[i] if i < b.size else 0


@_compiled(inline="always")
def _skip_ws(b, i):
    while i < b.size and (b[i] == 32 or b[i] == 10 or b[i] == 13 or b[i] == 9):
        i += 1
    return i


@_compiled(inline="always")
def _separator(b, i, close):
    """After an item, from ``i``: skip whitespace; a comma -> (start of the next item, _NEXT), the
    closing bracket ``close`` -> (its position, _CLOSE), anything else -> (i, _BAD)."""
    i = _skip_ws(b, i)
    c = _at(b, i)
    if c == 44:  # ','
        return _skip_ws(b, i + 1), _NEXT
    if c == close:
        return i, _CLOSE
    return i, _BAD


@_compiled(inline="always")
def _number(b, i):
    """-> (value, position after it); value -1 if there is no number of 1.._MAX_DIGITS digits
    without a leading zero at ``i``."""
    v = 0
    j = i
    while j < b.size and 48 <= b[j] <= 57:
        v = v * 10 + (b[j] - 48)
        j += 1
    nd = j - i
    if nd == 0 or nd > _MAX_DIGITS or (nd > 1 and b[i] == 48):
        return -1, j
    return v, j


@_compiled(inline="always")
def _id_lists(b, i, vals, nv, k):
    """A list of id lists from its '[' at ``i``: ids appended to ``vals`` from ``nv``, every list ``k``
    long (k < 0: set by the first list). -> (status, position after its ']', nv, lists, k)."""
    nl = 0
    i = _skip_ws(b, i + 1)
    while True:
        if _at(b, i) != 91:
            return _FAIL, i, nv, nl, k
        i = _skip_ws(b, i + 1)
        cnt = 0
        while True:  # ids
            v, i = _number(b, i)
            if v < 0:
                return _FAIL, i, nv, nl, k
            vals[nv] = v
            nv += 1
            cnt += 1
            i, sep = _separator(b, i, 93)
            if sep == _CLOSE:
                break
            if sep == _BAD:
                return _FAIL, i, nv, nl, k
        if k < 0:
            k = cnt
        elif cnt != k:
            return _FAIL, i, nv, nl, k
        nl += 1
        i, sep = _separator(b, i + 1, 93)
        if sep == _CLOSE:
            break
        if sep == _BAD:
            return _FAIL, i, nv, nl, k
    return _OK, i + 1, nv, nl, k


@_compiled(nogil=True)  # releases the GIL: the import overlaps its other work with the scan
def _scan(b, vals, m_elem, m_key, m_start, m_nl):
    """One pass over the bytes: every object member (element, key, first value index, number of
    id lists, or -1 for null) and every id in order. -> (status, members, ids, elements, k)."""
    nm = nv = n_elem = 0
    k = -1
    i = _skip_ws(b, 0)
    if _at(b, i) != 91:  # '['
        return _FAIL, 0, 0, 0, 0
    i = _skip_ws(b, i + 1)
    while True:  # elements
        if _at(b, i) != 123:  # '{'
            return _FAIL, 0, 0, 0, 0
        i = _skip_ws(b, i + 1)
        while True:  # members
            if _at(b, i) != 34:  # '"'
                return _FAIL, 0, 0, 0, 0
            key, i = _number(b, i + 1)
            if key < 0 or _at(b, i) != 34:
                return _FAIL, 0, 0, 0, 0
            i = _skip_ws(b, i + 1)
            if _at(b, i) != 58:  # ':'
                return _FAIL, 0, 0, 0, 0
            i = _skip_ws(b, i + 1)
            start = nv
            c = _at(b, i)
            if c == 110:  # null
                if _at(b, i + 1) != 117 or _at(b, i + 2) != 108 or _at(b, i + 3) != 108:
                    return _FAIL, 0, 0, 0, 0
                i += 4
                nl = -1
            elif c == 91:  # '[' a list of id lists
                status, i, nv, nl, k = _id_lists(b, i, vals, nv, k)
                if status != _OK:
                    return _FAIL, 0, 0, 0, 0
            else:
                return _FAIL, 0, 0, 0, 0
            m_elem[nm] = n_elem
            m_key[nm] = key
            m_start[nm] = start
            m_nl[nm] = nl
            nm += 1
            i, sep = _separator(b, i, 125)
            if sep == _CLOSE:
                break
            if sep == _BAD:
                return _FAIL, 0, 0, 0, 0
        n_elem += 1
        i, sep = _separator(b, i + 1, 93)
        if sep == _CLOSE:
            break
        if sep == _BAD:
            return _FAIL, 0, 0, 0, 0
    if _skip_ws(b, i + 1) != b.size or k < 0:
        return _FAIL, 0, 0, 0, 0
    return _OK, nm, nv, n_elem, k


@_compiled(nogil=True)  # releases the GIL: the import overlaps its other work with the scan
def _build(vals, m_elem, m_key, m_start, m_nl, nm, n_elem, k):
    """The scanned members -> (status, layer ids, prefill counts [L, E], decode picks [N, L, k], T, E),
    checking what the JSON path requires (same token count per prefill layer, each decode step one
    list per MoE layer) and declining duplicate keys, which a JSON parse would resolve silently."""
    fail = (_FAIL, np.zeros(0, np.int64), np.zeros((0, 0), np.int32), np.zeros((0, 0, 0), np.int16), 0, 0)
    n0 = 0
    while n0 < nm and m_elem[n0] == 0:
        n0 += 1
    n_keys = 0
    for j in range(nm):
        n_keys = max(n_keys, m_key[j] + 1)
    seen = np.full(n_keys, -1, np.int64)  # key -> last element it was seen in
    L = 0
    T = -1
    for j in range(n0):
        key = m_key[j]
        if seen[key] == 0:
            return fail
        seen[key] = 0
        if m_nl[j] >= 0:
            L += 1
            if T < 0:
                T = m_nl[j]
            elif m_nl[j] != T:
                return fail
    if L == 0:
        return fail
    layers = np.empty(L, np.int64)
    L = 0
    for j in range(n0):
        if m_nl[j] >= 0:
            layers[L] = m_key[j]
            L += 1
    layers.sort()
    rank = np.full(n_keys, -1, np.int64)
    for r in range(L):
        rank[layers[r]] = r
    E = 0
    for j in range(nm):
        if m_nl[j] > 0:
            for x in range(m_start[j], m_start[j] + m_nl[j] * k):
                E = max(E, vals[x] + 1)
    prefill = np.zeros((L, E), np.int32)
    for j in range(n0):
        if m_nl[j] >= 0:
            r = rank[m_key[j]]
            for x in range(m_start[j], m_start[j] + T * k):
                prefill[r, vals[x]] += 1
    picks = np.zeros((n_elem - 1, L, k), np.int16)
    filled = np.zeros(n_elem, np.int64)  # MoE layers with picks, per decode step
    for j in range(n0, nm):
        e = m_elem[j]
        key = m_key[j]
        if seen[key] == e:
            return fail
        seen[key] = e
        r = rank[key]
        if m_nl[j] < 0:
            if r >= 0:
                return fail  # a MoE layer without picks: the JSON path explains
            continue
        if r < 0 or m_nl[j] != 1:
            return fail
        for x in range(k):  # insertion sort: k is small, a library sort per row costs more
            v = vals[m_start[j] + x]
            y = x
            while y > 0 and picks[e - 1, r, y - 1] > v:
                picks[e - 1, r, y] = picks[e - 1, r, y - 1]
                y -= 1
            picks[e - 1, r, y] = v
        filled[e] += 1
    for e in range(1, n_elem):
        if filled[e] != L:
            return fail
    return _OK, layers, prefill, picks, T, E


_scratch: dict[str, np.ndarray] = {}


def _buffers(n_bytes: int):
    """Scratch arrays for the scan, kept between files: a fresh megabyte per file would cost more in
    page faults than the scan itself. Each id and each member takes at least two bytes."""
    cap = n_bytes // 2 + 1
    if _scratch.get("vals", np.zeros(0)).size < cap:
        _scratch["vals"] = np.empty(cap, np.int16)
        _scratch["members"] = np.empty((4, cap // 4 + 1), np.int64)
    return _scratch["vals"], _scratch["members"]


_loaded = False


def load() -> None:
    """Load the compiled parser (from numba's cache, or compile it) on a two-line file.

    On its first compile or cache load numba imports its numpy support, one module of which probes
    for a BLAS by importing scipy.linalg: 0.15-0.4 s of every import, for a parser that calls no
    BLAS. That happens here with scipy.linalg hidden (unless something imported it already); numba
    then only records that its own compiled ``np.dot`` has no BLAS, which no eldr code uses."""
    global _loaded
    if _loaded:
        return
    hide = "scipy.linalg" not in sys.modules
    if hide:
        sys.modules["scipy.linalg"] = None  # type: ignore[assignment]  # import -> ImportError
    try:
        _loaded = True
        fast_parse(b'[{"0":[[1]]},{"0":[[1]]}]')
    except BaseException:
        _loaded = False
        raise
    finally:
        if hide and sys.modules.get("scipy.linalg", 0) is None:
            del sys.modules["scipy.linalg"]


def fast_parse(raw: bytes):
    """-> (layer ids tuple, prefill int32 [L, E], decode picks int16 [N, L, k], T, E) for the common
    layout, or None (then the JSON parser decides). Same result as the JSON path."""
    if not _loaded:
        load()
    b = np.frombuffer(raw, dtype=np.uint8)
    vals, (m_elem, m_key, m_start, m_nl) = _buffers(b.size)
    status, nm, _nv, n_elem, k = _scan(b, vals, m_elem, m_key, m_start, m_nl)
    if status != _OK:
        return None
    status, layers, prefill, picks, T, E = _build(vals, m_elem, m_key, m_start, m_nl, nm, n_elem, k)
    if status != _OK:
        return None
    return tuple(int(x) for x in layers), prefill, picks, int(T), int(E)
