"""The compact, versioned encoding of a request's expert counts inside ``kv_transfer_params``.

Schema: ``manifests/handoff-signature.v1.schema.json``. The prefill worker (the vLLM plugin or
the emulator) puts ``encode_counts(counts)`` under ``kv_transfer_params[SIGNATURE_KEY]``; the proxy
pops it with :func:`pop_signature` before forwarding ``kv_transfer_params`` to the decoder.
"""

from __future__ import annotations

import base64
import zlib
from typing import Callable

import numpy as np

_fast_b64decode: Callable[..., bytes] | None
try:  # SIMD base64 (in requirements.lock; optional): several times faster on the request path
    from pybase64 import b64decode as _fast_b64decode
except ImportError:  # pragma: no cover
    _fast_b64decode = None
_fast_inflate: Callable[[bytes], bytes] | None
try:  # ISA-L's inflate (in requirements.lock; optional): about twice zlib's speed on the request path
    from isal.isal_zlib import decompress as _fast_inflate
except ImportError:  # pragma: no cover
    _fast_inflate = None

SIGNATURE_KEY = "eldr_signature"
VERSION = 1
_DTYPES = {"u1": np.uint8, "u2": np.uint16, "u4": np.uint32}
_WIRE = {code: np.dtype(t).newbyteorder("<") for code, t in _DTYPES.items()}  # the little-endian wire dtypes
WIRE_DTYPES = tuple(np.dtype(t) for t in _DTYPES.values())  # what decode_counts(widen=False) returns


# Counts of at most this many bytes go in zlib's stored blocks (level 0: the same format, any zlib reader takes it):
# 48 x 128 one-byte counts are 6 KB, 8.2 KB in base64 against 3.2 KB deflated at level 1, but inflating a stored
# stream is a copy and a checksum (1 us against 11-15, ISA-L, in a tight loop; 25-32 in the proxy, where its caches
# are cold) and storing it costs the prefill worker 5 us against 53. Larger counts are deflated (level 1).
STORED_MAX = 16384


class SignatureDecodeError(ValueError):
    """A signature field that is present but malformed (the proxy falls back to JSQ)."""


def encode_counts(counts: np.ndarray, tokens: int | None = None) -> dict:
    """counts: int [L, E], non-negative -> JSON-able dict (smallest unsigned dtype that fits)."""
    c = np.asarray(counts)
    if c.ndim != 2:
        raise ValueError(f"counts must be [L, E], got shape {c.shape}")
    if c.size and c.min() < 0:
        raise ValueError("counts must be non-negative")
    top = int(c.max()) if c.size else 0
    code = "u1" if top < 2**8 else "u2" if top < 2**16 else "u4"
    raw = np.ascontiguousarray(c, dtype=np.dtype(_DTYPES[code]).newbyteorder("<")).tobytes()
    level = 0 if len(raw) <= STORED_MAX else 1
    out = {"v": VERSION, "shape": [int(c.shape[0]), int(c.shape[1])], "dtype": code,
           "encoding": "zlib+b64", "data": base64.b64encode(zlib.compress(raw, level)).decode("ascii")}
    if tokens is not None:
        out["tokens"] = int(tokens)
    return out


def decode_counts(obj: dict, widen: bool = True) -> np.ndarray:
    """Inverse of :func:`encode_counts`: int64 [L, E] (``widen=False``: in the wire's unsigned width, native byte
    order, read-only where that is the wire's order (a view of the inflated bytes); the proxy's request path,
    whose compiled loops read any integer width). Raises SignatureDecodeError when malformed."""
    try:
        if obj.get("v") != VERSION:
            raise SignatureDecodeError(f"signature version {obj.get('v')!r} is not {VERSION}")
        L, E = (int(x) for x in obj["shape"])
        dt = _WIRE[obj["dtype"]]
        if obj.get("encoding") != "zlib+b64":
            raise SignatureDecodeError(f"unknown signature encoding {obj.get('encoding')!r}")
        raw = _inflate(_b64decode(obj["data"]))
        if not widen and len(raw) == L * E * dt.itemsize and dt.isnative and L >= 0:
            return np.ndarray((L, E), dtype=dt, buffer=raw)  # a read-only view of the inflated bytes: no copy
        arr = np.frombuffer(raw, dtype=dt)
        if arr.size != L * E:
            raise SignatureDecodeError(f"signature has {arr.size} values, shape says {L}x{E}")
        return arr.reshape(L, E).astype(np.int64 if widen else arr.dtype.newbyteorder("="))
    except SignatureDecodeError:
        raise
    except (KeyError, TypeError, ValueError, zlib.error, AttributeError) as e:
        raise SignatureDecodeError(f"malformed signature: {e}") from None


def _b64decode(data: str) -> bytes:
    """``base64.b64decode(data, validate=True)``: pybase64 where it accepts (it then gives the same bytes), the
    standard library's answer where it does not (it refuses some inputs the standard library takes, such as
    excess padding): the same bytes and the same refusals as before, the fast path for every well-formed one."""
    if _fast_b64decode is not None:
        try:
            return _fast_b64decode(data, validate=True)
        except ValueError:
            pass
    return base64.b64decode(data, validate=True)


def _inflate(data: bytes) -> bytes:
    """``zlib.decompress(data)``: ISA-L's where it accepts (zlib's format is lossless: the same bytes; it checks the
    same Adler-32), zlib's answer where it does not: the same bytes and the same refusals as before."""
    if _fast_inflate is not None:
        try:
            return _fast_inflate(data)
        except Exception:  # noqa: BLE001 - isal_zlib.error and kin: zlib says what is wrong, in its words
            pass
    return zlib.decompress(data)


def pop_signature(kv_transfer_params: dict | None) -> dict | None:
    """Remove and return the encoded signature from a prefill answer's kv_transfer_params."""
    if not isinstance(kv_transfer_params, dict):
        return None
    return kv_transfer_params.pop(SIGNATURE_KEY, None)
