"""Router state shared between proxy replicas (``eldr serve-proxy --state redis://HOST:PORT[/DB]``).

The locality band needs every replica to see every decoder's load, or replicas pile requests onto
the same "least loaded" decoder. What is shared, and how:

- **In-flight counts.** Each replica's own counts stay exact locally (the proxy's ``Worker.inflight``).
  When they change, the replica publishes all of them (absolute values, with a version number) on
  ``<ns>:counts``: the first change after a quiet spell at once, a burst at most once per
  ``COALESCE_S`` (10 ms), so the others see a dispatch within a few ms at under one message per
  request. Every ``HEARTBEAT_S`` it also writes them to its own hash ``<ns>:inflight:<replica>``
  with a TTL of ``TTL_MS`` and reads the other live replicas' hashes
  (which repairs any lost message: the newer version wins). The sum over the other replicas is
  ``Worker.remote_inflight``, which the decision adds to the local count. A replica that dies stops
  counting when its hash expires: within ``STALENESS_BOUND_S`` = TTL + one heartbeat (1.3 s).
  A decision never waits for Redis: it reads the last counts that arrived.
- **Run-time changes.** An admin change (policy, routing reload, worker add/remove) is validated and
  applied locally first (so a change refused on one replica is published nowhere), then published on
  ``<ns>:admin``; every other replica applies the same change. Health transitions (a worker marked
  down or up by a replica's checker) are published the same way.
- **Outage.** If Redis cannot be reached, each replica routes on its local counts alone (the remote
  counts are dropped, not frozen), logs the outage once and counts it; sharing resumes by itself
  when Redis answers again. No request path touches Redis, so none fails because of it.

Decision logs stay per replica. :class:`LocalState` is the single-process default (nothing shared).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson

from eldr_cli.errors import EldrError

log = logging.getLogger("eldr.proxy.state")

HEARTBEAT_S = 0.1
COALESCE_S = 0.01  # count changes within 10 ms go out as one message
TTL_MS = 1200
STALENESS_BOUND_S = TTL_MS / 1000 + HEARTBEAT_S


class StateHost(Protocol):
    """What a shared state needs from the proxy app (``ProxyApp`` implements it)."""

    def all_workers(self) -> list[Any]: ...

    def apply_remote_change(self, action: str, body: dict[str, Any]) -> None: ...


def parse_state_url(value: str | None) -> str:
    """``local`` or a ``redis://HOST:PORT[/DB]`` URL, checked; raises EldrError naming --state."""
    if value is None or value == "local":
        return "local"
    try:
        u = urlsplit(value)
        port = u.port
        db = u.path.strip("/")
    except ValueError as e:
        raise EldrError(f"--state {value!r} is not a valid URL: {e}") from None
    if u.scheme != "redis" or not u.hostname or port is None or (db and not db.isdigit()):
        raise EldrError(f"--state must be 'local' or redis://HOST:PORT[/DB], got {value!r}")
    return value


class LocalState:
    """One process, nothing shared: the embedded default."""

    kind = "local"

    def __init__(self) -> None:
        self.replica_id = uuid.uuid4().hex[:8]
        self.errors = 0
        self.outages = 0
        self.in_outage = False

    @property
    def live_replicas(self) -> int:
        return 1

    def sync_age_s(self) -> float:
        return 0.0

    async def start(self, host: StateHost) -> None:
        return None

    async def stop(self) -> None:
        return None

    def publish_change(self, action: str, body: dict[str, Any]) -> None:
        return None

    def note_change(self) -> None:
        """This replica's in-flight counts changed (called on every dispatch and completion)."""
        return None


class RedisState(LocalState):
    """In-flight counts and run-time changes shared through one Redis server (see module doc)."""

    kind = "redis"

    def __init__(self, url: str, namespace: str = "eldr") -> None:
        super().__init__()
        self.url = url
        # pub/sub channels are server-wide, not per database: the database number is part of every name
        self.ns = f"{namespace}:{urlsplit(url).path.strip('/') or '0'}"
        self._replicas = 1
        self._last_sync = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._host: StateHost | None = None
        self._redis: Any = None
        self._channel = f"{self.ns}:admin"
        self._counts_channel = f"{self.ns}:counts"
        self.version = 0  # of this replica's published counts
        self._others: dict[str, tuple[int, dict[str, int]]] = {}  # replica -> (version, counts)
        self._flush_scheduled = False
        self._last_flush = float("-inf")  # loop time of the last counts message

    def _key(self, replica: str) -> str:
        return f"{self.ns}:inflight:{replica}"

    @property
    def live_replicas(self) -> int:
        return self._replicas

    def sync_age_s(self) -> float:
        return time.monotonic() - self._last_sync

    async def start(self, host: StateHost) -> None:
        import redis.asyncio as aioredis

        self._host = host
        self._redis = aioredis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5,
                                        health_check_interval=0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat_loop()), loop.create_task(self._subscribe_loop())]
        log.info("shared state", extra={"event": "state", "state": "redis", "replica": self.replica_id,
                                        "staleness_bound_s": STALENESS_BOUND_S})

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._redis is not None:
            try:  # a clean stop leaves no counts behind (a crash leaves them until the TTL)
                await self._redis.delete(self._key(self.replica_id))
                await self._redis.srem(f"{self.ns}:replicas", self.replica_id)
            except Exception:
                pass
            try:
                await self._redis.aclose()
            except Exception:
                pass
            self._redis = None

    # -- counts ---------------------------------------------------------------------------------
    async def sync_once(self) -> None:
        """Publish this replica's counts and read the others' (one heartbeat)."""
        assert self._host is not None and self._redis is not None
        workers = self._host.all_workers()
        self.version += 1
        mine = {f"{w.role}|{w.url}": w.inflight for w in workers}
        mine["_v"] = self.version  # also keeps the hash in existence when the replica has no workers
        key = self._key(self.replica_id)
        reg = f"{self.ns}:replicas"
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key).hset(key, mapping=mine).pexpire(key, TTL_MS).sadd(reg, self.replica_id).smembers(reg)
        res = await pipe.execute()
        others = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in res[-1])
        others = [o for o in others if o != self.replica_id]
        hashes = []
        if others:
            pipe = self._redis.pipeline(transaction=False)
            for o in others:
                pipe.hgetall(self._key(o))
            hashes = await pipe.execute()
        gone, live = [], {}
        for o, h in zip(others, hashes, strict=True):
            if not h:
                gone.append(o)  # expired: the replica stopped or died
                continue
            counts = {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in h.items()}
            live[o] = (counts.pop("_v", 0), counts)
        if gone:
            await self._redis.srem(reg, *gone)
        for o, (v, counts) in live.items():  # a message newer than the hash wins
            if o not in self._others or self._others[o][0] < v:
                self._others[o] = (v, counts)
        self._others = {o: vc for o, vc in self._others.items() if o in live}
        self._apply_remote()
        self._replicas = 1 + len(live)
        self._last_sync = time.monotonic()
        if self.in_outage:
            self.in_outage = False
            log.warning("shared state back: Redis answers again", extra={"event": "state", "to": "shared"})

    def _apply_remote(self) -> None:
        remote: dict[str, int] = {}
        for _, counts in self._others.values():
            for k, v in counts.items():
                remote[k] = remote.get(k, 0) + v
        if self._host is not None:
            for w in self._host.all_workers():
                w.remote_inflight = remote.get(f"{w.role}|{w.url}", 0)

    def note_change(self) -> None:
        if self._flush_scheduled or self._redis is None or self.in_outage:
            return
        # the first change after a quiet spell goes out at once (after this loop turn); a burst of
        # changes goes out at most once per COALESCE_S
        self._flush_scheduled = True
        loop = asyncio.get_running_loop()
        wait = self._last_flush + COALESCE_S - loop.time()
        if wait <= 0:
            loop.call_soon(self._flush)
        else:
            loop.call_later(wait, self._flush)

    def _flush(self) -> None:
        """One message with all of this replica's counts, for the changes of the last COALESCE_S."""
        self._flush_scheduled = False
        if self._host is None or self._redis is None:
            return
        self._last_flush = asyncio.get_running_loop().time()
        self.version += 1
        msg = orjson.dumps({"origin": self.replica_id, "v": self.version,
                            "counts": {f"{w.role}|{w.url}": w.inflight for w in self._host.all_workers()}})
        task = asyncio.get_running_loop().create_task(self._publish(msg, self._counts_channel))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _on_counts(self, data: bytes) -> None:
        try:
            msg = orjson.loads(data)
            origin, v, counts = msg["origin"], int(msg["v"]), msg["counts"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return
        if origin == self.replica_id or not isinstance(counts, dict):
            return
        if origin not in self._others or self._others[origin][0] < v:
            self._others[origin] = (v, {str(k): int(c) for k, c in counts.items()})
            self._apply_remote()

    def _failed(self, e: BaseException, *, outage: bool = True) -> None:
        """A failed Redis operation. Only the heartbeat decides that Redis is unreachable (``outage``):
        a publish or subscription that fails around the same time is the same outage, counted once."""
        self.errors += 1
        if not outage:
            return
        if not self.in_outage:
            self.in_outage = True
            self.outages += 1
            log.warning("shared state unreachable: routing on this replica's counts alone until Redis answers",
                        extra={"event": "state", "to": "local", "error": f"{type(e).__name__}: {e}"})
        self._others = {}  # stale counts of other replicas would mislead the band
        self._apply_remote()
        self._replicas = 1

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.sync_once(), timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down, timeouts, protocol errors: local routing
                self._failed(e)
            await asyncio.sleep(HEARTBEAT_S)

    # -- run-time changes -----------------------------------------------------------------------
    def publish_change(self, action: str, body: dict[str, Any]) -> None:
        if self._redis is None:
            return
        msg = orjson.dumps({"origin": self.replica_id, "action": action, "body": body})
        task = asyncio.get_running_loop().create_task(self._publish(msg, self._channel))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _publish(self, msg: bytes, channel: str) -> None:
        try:
            await asyncio.wait_for(self._redis.publish(channel, msg), timeout=1.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(e, outage=False)
            if channel == self._channel:
                log.warning("a run-time change was not shared (Redis unreachable): other replicas keep theirs",
                            extra={"event": "state", "error": str(e)})

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = None
            try:
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(self._channel, self._counts_channel)
                while True:
                    m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if m is None or m.get("type") != "message":
                        continue
                    ch = m["channel"].decode() if isinstance(m["channel"], bytes) else m["channel"]
                    if ch == self._counts_channel:
                        self._on_counts(m["data"])
                    else:
                        self._on_message(m["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(e, outage=False)
                await asyncio.sleep(HEARTBEAT_S)
            finally:
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass

    def _on_message(self, data: bytes) -> None:
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(msg, dict) or msg.get("origin") == self.replica_id:
            return
        action, body = msg.get("action"), msg.get("body")
        if isinstance(action, str) and isinstance(body, dict) and self._host is not None:
            self._host.apply_remote_change(action, body)


def make_shared_state(spec: str) -> LocalState:
    spec = parse_state_url(spec)
    return LocalState() if spec == "local" else RedisState(spec)
