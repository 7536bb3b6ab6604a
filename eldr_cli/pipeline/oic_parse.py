"""The fast path of the trace import: one Orders-in-Chaos file parsed with a few vectorised passes.

It accepts only what it can prove is the common layout (small integer ids, quoted integer layer keys,
``null`` dense layers, any JSON whitespace, any key order) and returns None for everything else, so
the JSON parser in ``import_trace`` decides those files; on what it accepts, it returns exactly what
the JSON path returns (the tests compare both on every shape and layout).
"""

from __future__ import annotations

import numpy as np

_ALLOWED = np.zeros(256, dtype=bool)
for _c in b"0123456789[]{},: \t\r\nnul\"":
    _ALLOWED[_c] = True
_WS = np.zeros(256, dtype=bool)
for _c in b" \t\r\n":
    _WS[_c] = True
_QUOTE, _COMMA, _COLON, _LSQ, _RSQ, _LBR, _RBR = b'",:[]{}'


def _numbers(b: np.ndarray):
    """(end position, value) of every integer of at most 3 digits in the byte array ``b``, or None
    if there are longer numbers or numbers with leading zeros (the JSON path decides then).

    Expert and layer ids are below 1000, so a number's value is read from its last three bytes at
    once: a few passes over the bytes and the rest per number, several times cheaper than
    locating every digit run.
    """
    d = b - np.uint8(48)  # digits -> 0..9, everything else wraps to >= 10
    isd = d < 10
    ends = np.flatnonzero(isd[:-1] & ~isd[1:])
    if ends.size == 0:
        return None
    # ends >= 1 since b[0] is '['; negative indices below reach the last bytes, which are not digits
    d1 = isd[ends - 1]
    d2 = d1 & isd[ends - 2]
    if (d2 & isd[ends - 3]).any():
        return None
    first = ends - d1 - d2
    if ((d1 | d2) & (d[first] == 0)).any():
        return None  # leading zero: not JSON
    vals = d[ends].astype(np.int64)
    vals += 10 * d[ends - 1] * d1
    vals += 100 * d[ends - 2].astype(np.int64) * d2
    return ends, first, vals


def _next_byte(b: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The first non-whitespace byte after each position (compact or ", "-separated files need no search)."""
    nxt = b[pos + 1]
    if _WS[nxt].any():
        solid = np.flatnonzero(~_WS[b])
        nxt = b[solid[np.searchsorted(solid, pos, side="right")]]
    return nxt


def fast_parse(raw: bytes):
    """Vectorised parse of the common case (small integers, brackets, quoted integer keys, null); None
    if the file uses anything else, then the JSON parser decides. Same result as the JSON path."""
    raw = raw.strip(b" \t\r\n")  # the whitespace JSON allows around the document
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size < 2 or b[0] != _LSQ or b[-1] != _RSQ:
        return None
    hist = np.bincount(b, minlength=256)
    if hist[~_ALLOWED].any():
        return None
    n_null = raw.count(b"null")  # every n, u, l must belong to a "null"
    if not hist[ord("n")] == hist[ord("u")] == n_null or hist[ord("l")] != 2 * n_null:
        return None
    found = _numbers(b)
    if found is None:
        return None
    ends, first, vals = found
    nxt = _next_byte(b, ends)
    # strings may only be quoted integer keys: "<digits>"
    is_key = nxt == _QUOTE
    if int(hist[_QUOTE]) != 2 * int(is_key.sum()) or not (b[first[is_key] - 1] == _QUOTE).all():
        return None
    if int(hist[_COLON]) != int(is_key.sum()):
        return None
    brace_pos = np.flatnonzero(b == _LBR)
    n_elem = int(brace_pos.size)
    if n_elem == 0 or int(hist[_RBR]) != n_elem:
        return None
    val = ~is_key
    if not ((nxt[val] == _COMMA) | (nxt[val] == _RSQ)).all():
        return None
    elem = np.searchsorted(brace_pos, ends, side="right") - 1
    ridx = np.where(is_key, np.arange(ends.size), -1)
    last_key = np.maximum.accumulate(ridx)
    if (last_key[val] < 0).any():
        return None
    v_layer = vals[last_key[val]]
    v_elem = elem[val]
    v = vals[val]
    if v.size == 0:
        return None
    # every innermost list holds k ids: list ends (a ']' after the id) fall on k-1, 2k-1, ...
    last_in_list = np.flatnonzero(nxt[val] == _RSQ)
    k = int(last_in_list[0]) + 1
    if v.size % k or not np.array_equal(last_in_list, np.arange(k - 1, v.size, k)):
        return None
    n0 = int(np.searchsorted(v_elem, 1))  # values of element 0 come first
    layers = np.unique(v_layer[:n0])
    if layers.size == 0:
        return None
    L = layers.size
    if int(v_layer.max()) > int(layers[-1]):
        return None
    lut = np.full(int(layers[-1]) + 1, -1, dtype=np.int64)
    lut[layers] = np.arange(L)
    lrank = lut[v_layer]
    if (lrank < 0).any():
        return None  # a layer present in decode but not in prefill: let the JSON path explain
    cell = v_elem * L + lrank
    counts = np.bincount(cell, minlength=n_elem * L).reshape(n_elem, L)
    T, rem = divmod(int(counts[0, 0]), k)
    if rem or T == 0 or (counts[0] != T * k).any() or (n_elem > 1 and (counts[1:] != k).any()):
        return None
    # brackets: the outer list, per MoE layer a list of T token lists in prefill and of 1 per decode step
    n_lists = 1 + L * (T + 1) + (n_elem - 1) * L * 2
    if int(hist[_LSQ]) != n_lists or int(hist[_RSQ]) != n_lists:
        return None
    if (cell[1:] < cell[:-1]).any():
        # key order inside an element may differ from sorted order: stable sort by (element, layer)
        v = v[np.argsort(cell, kind="stable")]
    E = int(v.max()) + 1
    pre = v[:L * T * k].reshape(L, T * k)
    flat = pre + (np.arange(L) * E)[:, None]
    prefill = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E).astype(np.int32)
    picks = np.sort(v[L * T * k:].reshape(n_elem - 1, L, k), axis=-1).astype(np.int16)
    return tuple(int(x) for x in layers), prefill, picks, T, E
