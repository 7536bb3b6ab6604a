"""Reading shared state that anyone with Redis access may have filled with garbage (issue 28, item 4).

Every key and member is read on its own terms: a wrong type, a name that is not a replica id, a value
over its cap or one that does not verify is one bad entry (skipped, counted by reason, removed from
the registry), never a failed heartbeat. Values are read with ``GETRANGE key 0 CAP``: Redis sends at
most CAP + 1 bytes whatever the value's size, so a 100 MB value costs CAP bytes to notice. The outage
path (local routing) is only for Redis being unreachable or refusing this replica; :func:`outage_kind`
says which.
"""

from __future__ import annotations

import re
from typing import Any

MAX_VALUE_BYTES = 1 << 20  # a heartbeat (signed counts, and vectors of a stateful policy)
NEW_NAMES_BUDGET = 4 << 20  # bytes read per heartbeat under names not yet verified (sizes are read first)
MAX_RESERVED_FIELDS = 4096  # slots in the reservation hash: more is garbage (replicas x decoders is far less)
_NAME = re.compile(rb"[A-Za-z0-9_.-]{1,64}")
_REFUSING = ("NOAUTH", "WRONGPASS", "NOPERM", "READONLY", "MASTERDOWN", "LOADING", "OOM", "MISCONF")


def replica_name(member: Any) -> str | None:
    """A registry member as a replica id, or None (not bytes, not a plausible id)."""
    if isinstance(member, str):
        member = member.encode()
    if not isinstance(member, bytes) or not _NAME.fullmatch(member):
        return None
    return member.decode("ascii")


def outage_kind(e: BaseException) -> str | None:
    """"unreachable" (no connection, timeout), "refusing" (auth, ACL, read-only, out of memory, loading)
    or None (an error about one key's content: not an outage)."""
    from redis.exceptions import (
        AuthenticationError,
        BusyLoadingError,
        NoPermissionError,
        OutOfMemoryError,
        ReadOnlyError,
        ResponseError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(e, (AuthenticationError, NoPermissionError, ReadOnlyError, BusyLoadingError, OutOfMemoryError)):
        return "refusing"
    if isinstance(e, (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)):
        return "unreachable"
    if isinstance(e, ResponseError):
        text = str(e).upper()
        return "refusing" if any(text.startswith(w) or f" {w}" in text for w in _REFUSING) else None
    return "unreachable"


async def read_heartbeats(redis: Any, known: list[str], new: list[str], cap: int, budget: int) -> dict[str, Any]:
    """Values of ``known`` keys (verified replicas: read at once, capped) and of ``new`` keys (names from the
    registry, anyone's): their sizes first, then the values that fit ``cap`` while they fit ``budget`` in
    all; the rest waits for a later heartbeat. Missing: b""; over ``cap``: ValueError; wrong type: the error."""
    out: dict[str, Any] = {}
    take = list(known)
    if new:
        pipe = redis.pipeline(transaction=False)
        for k in new:
            pipe.strlen(k)
        left = budget
        for k, n in zip(new, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(n, Exception) or not isinstance(n, int):
                out[k] = n if isinstance(n, Exception) else ValueError("not a length")
            elif n == 0:
                out[k] = b""
            elif n > cap:
                out[k] = ValueError("oversized")
            elif n <= left:
                left -= n
                take.append(k)
    out.update(zip(take, await read_capped(redis, take, cap), strict=True))
    return out


async def read_capped(redis: Any, keys: list[str], cap: int) -> list[Any]:
    """Each key's value as bytes (b"": missing), a ValueError when over ``cap``, or the key's own error
    (a wrong type): one round trip, at most ``cap + 1`` bytes a key."""
    if not keys:
        return []
    pipe = redis.pipeline(transaction=False)
    for k in keys:
        pipe.getrange(k, 0, cap)
    out: list[Any] = []
    for v in await pipe.execute(raise_on_error=False):
        if isinstance(v, bytes) and len(v) > cap:
            v = ValueError("oversized")
        out.append(v)
    return out


async def check_reserved(redis: Any, reserver: Any, env: Any) -> None:
    """The reservation hash, bounded: a wrong type, or more fields than replicas x decoders could hold, is
    garbage, removed (reservations start again from zero); else the slots of dead replicas are dropped."""
    from redis.exceptions import ResponseError

    try:
        n = await redis.hlen(reserver.key)
    except ResponseError as e:
        if outage_kind(e) is not None:
            raise
        n = None
        env.reject("wrong_type")
    if n is None or n > MAX_RESERVED_FIELDS:
        if n is not None:
            env.reject("oversized")
        await redis.delete(reserver.key)
        return
    try:
        await reserver.cleanup()
    except ResponseError as e:
        if outage_kind(e) is not None:
            raise
        env.reject("malformed")
