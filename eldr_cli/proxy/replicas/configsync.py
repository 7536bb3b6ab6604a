"""One run-time configuration for all replicas, versioned and signed, that survives restarts.

The first round of signing kept the replay memory (each origin's highest change sequence) in the
receivers' RAM, so a restarted replica applied any captured change republished within 30 s. Now:

- **Versions.** Every run-time change (admin policy/workers/reload, a health transition) carries a
  version ``(n, origin)``: one more than the highest its issuer knew. A replica applies a change only
  if its version is above every version it knows: its own, the signed snapshot's, and the ones the
  other replicas' *signed* heartbeats advertise (``cv``). A captured change is below all of them once
  anything newer happened, on every replica, restarted or not.
- **Join time.** A replica applies no change issued (by its signed timestamp) before it started: what
  was decided before, it takes from the snapshot, never from the channel.
- **Snapshot.** ``<ns>:config`` holds the signed current configuration (policy, tau, routing, pools,
  workers marked down) and its version. Every heartbeat each replica reads it (at most
  ``MAX_CONFIG_BYTES``): a newer version, or the same version with other content, is adopted; an
  older or missing one is rewritten from this replica's (so an attacker who deletes it or puts back an
  older signed one is undone within one heartbeat while any replica lives). It expires
  ``CONFIG_TTL_MS`` after the last replica stopped: a deployment restarted as a whole starts from its
  command lines.
- A restarted replica counts as synced after its first heartbeat (snapshot and signed heartbeats
  read); until then it applies no change from the channel (the snapshot brings them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from eldr_cli.proxy.replicas.auth import Envelope

Version = tuple[int, str]
ZERO: Version = (0, "")
CONFIG_TTL_MS = 60_000
MAX_CONFIG_BYTES = 256 * 1024


def parse_version(v: Any) -> Version | None:
    """``[n, origin]`` as sent, checked; None for anything else."""
    if isinstance(v, list) and len(v) == 2 and type(v[0]) is int and v[0] >= 0 and isinstance(v[1], str) \
            and len(v[1]) <= 64:
        return v[0], v[1]
    return None


class ConfigSync:
    """The version bookkeeping of one replica (:class:`eldr_cli.proxy.replicas.shared.RedisState` owns it)."""

    def __init__(self, env: Envelope, ns: str) -> None:
        self.env, self.key = env, f"{ns}:config"
        self.version: Version = ZERO      # of the configuration this replica runs
        self.peer_max: Version = ZERO     # highest version a live replica's signed heartbeat advertises
        self.synced = False
        self.joined_ms = int(time.time() * 1000)
        self._seen: tuple[bytes, Version] | None = None  # the snapshot bytes last handled, at our version then

    def known(self) -> Version:
        return max(self.version, self.peer_max)

    def seal_change(self, action: str, body: dict[str, Any]) -> bytes:
        """This replica's change, at the next version (which becomes this replica's)."""
        self.version = (self.known()[0] + 1, self.env.origin)
        return self.env.seal(action, {"v": list(self.version), "b": body})

    def seal_snapshot(self, config: dict[str, Any]) -> bytes:
        return self.env.seal("config", {"v": list(self.version), "c": config})

    def open_change(self, data: bytes | str, kinds: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
        """(action, body) of a change to apply now, or None (rejected and counted)."""
        msg = self.env.open(data, kinds, change=True)
        if msg is None:
            return None
        p = msg.payload
        v = parse_version(p.get("v")) if isinstance(p, dict) else None
        if v is None or v[1] != msg.origin or not isinstance(p.get("b"), dict):
            self.env.reject("malformed", origin=msg.origin)
            return None
        if msg.t < self.joined_ms:
            self.env.reject("before_join", origin=msg.origin)
            return None
        if not self.synced:
            self.env.reject("unsynced", origin=msg.origin)
            return None
        # at or below our version, or below what a live replica already runs: a replay of a change this
        # replica never saw, or one overtaken by another (equal to a peer's: its heartbeat overtook the message)
        if v <= self.version or v < self.peer_max:
            self.env.reject("outdated", origin=msg.origin)
            return None
        self.version = v
        return msg.kind, p["b"]

    def on_snapshot(self, raw: bytes | None, current: Callable[[], dict[str, Any]]) \
            -> tuple[str, dict[str, Any] | None]:
        """What to do with the stored snapshot ``raw`` (None: missing): ("adopt", config), ("write", None)
        or ("keep", None). ``current``: this replica's configuration now (read only when needed)."""
        if raw is not None and self._seen == (raw, self.version):
            return "keep", None  # nothing moved since the last heartbeat: no verify, no parse
        self._seen = (raw, self.version) if raw is not None else None
        snap = self._open_snapshot(raw) if raw is not None else None
        if snap is None or raw is None:
            return ("write", None) if self.version != ZERO else ("keep", None)
        v, config = snap
        if v < self.version:
            return "write", None
        if v < self.peer_max:
            return "keep", None  # an older snapshot (rolled back?) than a live replica runs: it rewrites it
        if v > self.version or config != current():
            self.version = v
            self._seen = (raw, v)  # tried once: a configuration this replica cannot run is not retried 10/s
            return "adopt", config
        return "keep", None

    async def sync(self, redis: Any, host: Any, raw: Any) -> None:
        """One heartbeat's look at the stored snapshot ``raw`` (GETRANGE's answer, or its error): adopted
        when newer, rewritten when older or missing; a key of the wrong type or size is one bad key
        (counted, deleted, rewritten once this replica has a version)."""
        if not isinstance(raw, bytes) or len(raw) > MAX_CONFIG_BYTES:
            self.env.reject("oversized" if isinstance(raw, bytes) else "wrong_type")
            await redis.delete(self.key)
            raw = None
        what, config = self.on_snapshot(raw or None, host.current_config)
        if what == "adopt" and config is not None:
            host.adopt_config(config)
        elif what == "write":
            await redis.set(self.key, self.seal_snapshot(host.current_config()), px=CONFIG_TTL_MS)
        self.synced = True

    def _open_snapshot(self, raw: bytes) -> tuple[Version, dict[str, Any]] | None:
        msg = self.env.open(raw, ("config",), timeless=True, own=True)
        if msg is None:
            return None
        p = msg.payload
        v = parse_version(p.get("v")) if isinstance(p, dict) else None
        if v is None or not isinstance(p.get("c"), dict):
            self.env.reject("malformed", origin=msg.origin)
            return None
        return v, p["c"]
