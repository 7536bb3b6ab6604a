"""Prefill selection: PrefixHash with a least-loaded fallback, the proxy's and the simulator's one prefill
policy. ``choose`` takes any pool whose ``workers`` have ``healthy``, ``salt`` (a per-worker hash salt) and
``load()`` (:class:`PrefillPool`): the proxy passes its ``eldr_cli.proxy.workers.WorkerPool``, the simulator
:class:`PrefillSlots` (the same salts, no connections)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# the defaults of the proxy (``ProxyConfig``) and of the simulator, which must place a prompt alike
BLOCK_CHARS = 256
BLOCKS = 4
OVERLOAD = 1.25


class PrefillPool(Protocol):
    """What :meth:`PrefixHashPrefill.choose` reads of a pool (the proxy's pool lives above routing)."""

    @property
    def workers(self) -> Sequence[Any]: ...


@dataclass
class PrefillSlot:
    """A prefill worker as :class:`PrefixHashPrefill` sees it: its hash salt, health and requests in flight."""

    id: str
    salt: int
    inflight: int = 0
    healthy: bool = True

    def load(self) -> int:
        return self.inflight


class PrefillSlots:
    """``n`` prefill workers for the simulator, salted as the proxy salts its pool's (ids p0, p1, ...), so a
    prompt meets the same prefill position in both."""

    def __init__(self, n: int):
        self.workers = [PrefillSlot(f"p{i}", zlib.crc32(f"p{i}".encode())) for i in range(n)]


def prompt_key(body: dict[str, Any], chat: bool) -> str:
    """The text whose leading blocks identify a prompt for prefix affinity."""
    if chat:
        parts = []
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}:{c or ''}\n")
        return "".join(parts)
    p = body.get("prompt")
    if isinstance(p, list):
        p = p[0] if p else ""
        if isinstance(p, list):  # token ids
            return ",".join(map(str, p))
        if isinstance(p, int):
            return ",".join(map(str, body["prompt"]))
    return p if isinstance(p, str) else ""


class PrefixHashPrefill:
    """PrefixHash: rendezvous-hash the prompt's first ``blocks`` blocks of ``block_chars`` characters
    onto the healthy prefill workers (so a shared prefix meets a warm prefix cache, and adding or
    removing a worker moves only its own keys); if the matched worker's load is above
    ``overload`` x the average prefill load, take the least-loaded worker instead."""

    def __init__(self, block_chars: int = BLOCK_CHARS, blocks: int = BLOCKS, overload: float = OVERLOAD):
        self.span = max(1, block_chars * blocks)
        self.overload = overload

    def choose(self, pool: PrefillPool, key: str, exclude: Any = None) -> Any:
        cands = [w for w in pool.workers if w.healthy and w is not exclude]
        if not cands:
            cands = [w for w in pool.workers if w is not exclude]  # all down: try anyway
            if not cands:
                return None
        if exclude is not None:  # a retry: the least-loaded other worker
            return min(cands, key=lambda w: w.load())
        kb = key[: self.span].encode("utf-8", "surrogatepass")
        best = max(cands, key=lambda w: zlib.crc32(kb, w.salt))
        avg = sum(w.load() for w in cands) / len(cands)
        if avg > 0 and best.load() > self.overload * avg:
            return min(cands, key=lambda w: w.load())
        return best
