"""Signed shared-state messages: one envelope for everything a replica publishes or writes to Redis.

A sealed message is ``TAG.BODY``: BODY is the JSON ``{"o": origin, "s": sequence, "t": unix ms,
"k": kind, "p": payload}`` exactly as sent, TAG the hex HMAC-SHA256 of ``namespace + "\\n" + BODY``
under the key every replica shares. The tag covers the bytes on the wire, so there is no second
encoding to get wrong, and the namespace, so a message of one deployment is worthless in another.
A receiver checks the tag before it parses anything, then the time window and (for run-time
changes) that the origin's sequence number grows; anything else is dropped, counted by reason
(``eldr_proxy_state_rejected_total{reason}``) and logged at most once per reason per minute with the
count since (so a flood of made-up origins cannot use up the log, nor hide a later rejection). Claimed
origins appear only hashed (:func:`origin_hash`), never as text an attacker chose.

The key: ``--state-key-file`` (only its owner may read it: mode 600 or 400), else ``$ELDR_STATE_KEY``,
else derived from the admin token (HKDF-SHA256 with a fixed label, so the token itself is never the MAC
key). Whichever it is must hold at least 256 bits by :func:`weakness`: a signed value is public to
anyone who can read Redis, so a guessable secret can be found offline at any speed. Never an option
value: the command line is visible to every user of the host.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from eldr_cli.errors import EldrError

log = logging.getLogger("eldr.proxy.state")

KEY_ENV = "ELDR_STATE_KEY"
MIN_KEY_BITS = 256
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
CHANGE_WINDOW_S = 30.0  # admin and health changes: older (or further ahead, clock skew) is stale
COUNTS_WINDOW_S = 5.0   # counts and heartbeats are rewritten every 0.1 s: a replay dies young
REASONS = ("unsigned", "bad_signature", "malformed", "stale", "replayed", "outdated", "before_join", "unsynced",
           "wrong_type", "oversized", "reservation_range", "ended")
_SALT = b"eldr serve-proxy shared state v1"
LOG_EVERY_S = 60.0  # a rejection is logged at most once per reason per minute, with the count since
WRONG_KEY_WINDOW_S = 60.0
_MAX_WRONG_KEY = 4096  # distinct claimed origins remembered (hashed); above, the count saturates


def _hkdf(ikm: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869), one 32-byte block."""
    prk = hmac.new(_SALT, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def weakness(secret: bytes) -> str | None:
    """Why ``secret`` is too weak to sign with (None: strong enough). A check of length per alphabet, not a
    proof of randomness: hex counts 4 bits a character, base64/base64url 6, other printable text 6.5, raw
    bytes 8; a secret with few distinct characters is refused whatever its length (``aaaa...``)."""
    s = secret.strip()
    try:
        text = s.decode("ascii")
    except UnicodeDecodeError:
        text = None
    if text is None or not text.isprintable():
        bits_per = 8.0
    elif all(c in "0123456789abcdef" for c in text.lower()):
        bits_per = 4.0
    elif all(c.isalnum() or c in "-_+/=" for c in text):
        bits_per = 6.0
    else:
        bits_per = 6.5
    bits = int(len(s) * bits_per)
    if bits < MIN_KEY_BITS:
        return f"holds about {bits} bits ({len(s)} characters); at least {MIN_KEY_BITS} are needed"
    if len(set(s)) < min(len(s) // 4, 12):
        return f"repeats a few characters ({len(set(s))} distinct in {len(s)}); it is not random"
    return None


def read_secret_file(path: str, flag: str) -> bytes:
    """A secret from a regular file that only its owner can read (mode & 077 == 0); EldrError naming ``flag``."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise EldrError(f"{flag} {path} does not exist") from None
    except OSError as e:
        raise EldrError(f"{flag} {path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise EldrError(f"{flag} {path} is not a regular file")
    if st.st_mode & 0o077:
        raise EldrError(f"{flag} {path} can be read or written by users other than its owner "
                        f"(mode {st.st_mode & 0o777:o})", hint=f"chmod 600 {path}")
    try:
        raw = p.read_bytes().strip()
    except OSError as e:
        raise EldrError(f"{flag} {path} cannot be read: {e.strerror}") from None
    if not raw:
        raise EldrError(f"{flag} {path} is empty")
    return raw


def _strong(secret: bytes, what: str, fix: str) -> bytes:
    why = weakness(secret)
    if why is not None:
        raise EldrError(f"{what} is too weak to sign the shared state: it {why}", hint=fix)
    return secret


def resolve_state_key(key_file: str | None, admin_token: str | None, state: str) -> tuple[bytes, str]:
    """(MAC key, where it came from) for ``--state redis://``; EldrError saying how to set one."""
    if key_file:
        raw = _strong(read_secret_file(key_file, "--state-key-file"), f"--state-key-file {key_file}",
                      f"{MAKE_ONE} > {key_file}; chmod 600 {key_file}")
        return _hkdf(raw, b"state key"), "key file"
    env = os.environ.get(KEY_ENV)
    if env:
        return _hkdf(_strong(env.encode(), KEY_ENV, f"export {KEY_ENV}=$({MAKE_ONE})"), b"state key"), KEY_ENV
    if admin_token:
        _strong(admin_token.encode(), "ELDR_ADMIN_TOKEN (the only key source)",
                f"set a separate {KEY_ENV}=$({MAKE_ONE}) on every replica, or make the token that strong")
        return _hkdf(admin_token.encode(), b"from admin token"), "admin token"
    raise EldrError(f"--state {state} needs a key every replica shares, to sign what they tell each other",
                    hint=f"export {KEY_ENV}=$({MAKE_ONE}) on every replica, or pass --state-key-file "
                         "FILE (mode 600)")


class Opened(NamedTuple):
    origin: str
    seq: int
    kind: str
    payload: Any
    t: int  # the sender's wall clock when it sealed, ms


class Envelope:
    """Seals this replica's messages and opens (verifies) the others'. Counters and the log-once memory
    live here, one per replica."""

    def __init__(self, key: bytes, namespace: str, origin: str):
        self._mac = hmac.new(key, namespace.encode() + b"\n", hashlib.sha256)  # copied per message
        self.origin = origin
        self.seq = 0
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.key_id = hmac.new(key, b"eldr key id", hashlib.sha256).hexdigest()[:12]  # reveals nothing of the key
        self.wrong_key: dict[str, float] = {}  # hash of a claimed origin -> wall time of its last bad signature
        self._last_change_seq: dict[str, int] = {}  # verified origin -> highest change sequence
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (monotonic time logged, rejections since)

    def _tag(self, body: bytes) -> bytes:
        m = self._mac.copy()
        m.update(body)
        return m.hexdigest().encode()

    def seal(self, kind: str, payload: Any) -> bytes:
        self.seq += 1
        body = orjson.dumps({"o": self.origin, "s": self.seq, "t": int(time.time() * 1000), "k": kind,
                             "p": payload})
        return self._tag(body) + b"." + body

    def open(self, data: bytes | str, kinds: tuple[str, ...], *, change: bool = False, timeless: bool = False,
             own: bool = False) -> Opened | None:
        """The verified message, or None (own echo, or rejected and counted). ``change``: a run-time
        change, whose sequence must grow per origin (a replay of one is refused even inside the window).
        ``timeless``: no time window (the configuration snapshot: versioned instead); ``own``: this
        replica's own messages too."""
        if isinstance(data, str):
            data = data.encode()
        tag, dot, body = data.partition(b".")
        if not dot or len(tag) != 64:
            self.reject("unsigned", data)
            return None
        if not hmac.compare_digest(self._tag(body), tag):
            self._note_wrong_key(body)
            self.reject("bad_signature", body)
            return None
        try:
            msg = orjson.loads(body)
            o, s, t, k, p = msg["o"], msg["s"], msg["t"], msg["k"], msg["p"]
            if not (isinstance(o, str) and type(s) is int and type(t) is int and k in kinds):
                raise ValueError("field types")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.reject("malformed", body)
            return None
        if o == self.origin and not own:
            return None
        window = CHANGE_WINDOW_S if change else COUNTS_WINDOW_S
        if not timeless and abs(time.time() * 1000 - t) > window * 1000:
            self.reject("stale", body, o)
            return None
        if change:
            if s <= self._last_change_seq.get(o, 0):
                self.reject("replayed", body, o)
                return None
            self._last_change_seq[o] = s
        return Opened(o, s, k, p, t)

    def reject(self, reason: str, body: bytes = b"", origin: str | None = None, n: int = 1) -> None:
        """Count ``n`` dropped messages; log the first of each reason per minute, with the count since."""
        self.rejected[reason] += n
        now = time.monotonic()
        last, since = self._logged.get(reason, (float("-inf"), 0))
        if now - last < LOG_EVERY_S:
            self._logged[reason] = (last, since + n)
            return
        self._logged[reason] = (now, n - 1)
        claimed = origin if origin is not None else _claimed_origin(body) if body else "?"
        log.warning("shared state: message ignored", extra={
            "event": "state_rejected", "replica": self.origin, "reason": reason, "origin_hash": origin_hash(claimed),
            "ignored_since_last_log": since})

    def _note_wrong_key(self, body: bytes) -> None:
        now = time.time()
        h = origin_hash(_claimed_origin(body))
        if h not in self.wrong_key and len(self.wrong_key) >= _MAX_WRONG_KEY:
            cutoff = now - WRONG_KEY_WINDOW_S
            self.wrong_key = {o: t for o, t in self.wrong_key.items() if t >= cutoff}
            if len(self.wrong_key) >= _MAX_WRONG_KEY:
                return  # saturated: the count says "at least this many"
        self.wrong_key[h] = now

    def wrong_key_view(self) -> dict[str, Any]:
        """Senders whose messages carry a well-formed tag made with another key, in the last minute: how
        many (distinct claimed origins) and one hash of the set; no attacker-chosen text."""
        cutoff = time.time() - WRONG_KEY_WINDOW_S
        live = sorted(o for o, t in self.wrong_key.items() if t >= cutoff)
        digest = hashlib.sha256(",".join(live).encode()).hexdigest()[:12] if live else None
        return {"origins": len(live), "saturated": len(self.wrong_key) >= _MAX_WRONG_KEY, "hash": digest,
                "this_key_id": self.key_id}


def origin_hash(origin: str) -> str:
    """A claimed origin as 12 hex characters (``sha256("eldr origin " + origin)``): an operator can hash a
    replica id to find it; an attacker's text never reaches a log line or /health."""
    return hashlib.sha256(b"eldr origin " + origin.encode("utf-8", "replace")).hexdigest()[:12]


def _claimed_origin(body: bytes) -> str:
    """The origin a message claims (unverified; for logs and /health only), bounded in length."""
    try:
        msg = orjson.loads(body)
        o = msg.get("o", msg.get("origin")) if isinstance(msg, dict) else None
    except orjson.JSONDecodeError:
        o = None
    return str(o)[:64] if o is not None else "?"
