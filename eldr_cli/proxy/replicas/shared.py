"""Router state shared between proxy replicas (``eldr serve-proxy --state redis[s]://HOST:PORT[/DB]``).

Every message and heartbeat a replica writes is signed (:mod:`eldr_cli.proxy.replicas.auth`); what fails
the check is dropped and counted. Connection options: :mod:`eldr_cli.proxy.replicas.conn`. Atomic
select-and-reserve of decode slots (the herd): :mod:`eldr_cli.proxy.replicas.reserve`.

The locality band needs every replica to see every decoder's load, or replicas pile requests onto
the same "least loaded" decoder. What is shared, and how:

- **In-flight counts.** Each replica's own counts stay exact locally (the proxy's ``Worker.inflight``).
  When they change, the replica publishes all of them (absolute values, with a version number) on
  ``<ns>:counts``: the first change after a quiet spell at once, a burst at most once per
  ``COALESCE_S`` (10 ms), so the others see a dispatch within a few ms at under one message per
  request. Every ``HEARTBEAT_S`` it also writes them to its own key ``<ns>:inflight:<replica>``
  with a TTL of ``TTL_MS`` and reads the other live replicas' keys (which repairs any lost message:
  the newer version wins). The sum over the other replicas is ``Worker.remote_inflight``, which the
  decision adds to the local count. The same message carries named per-worker integer vectors
  (``set_local_vectors``; for stateful policies), summed over the other replicas into
  ``Worker.remote_vectors[name]`` the same way. A replica that stops says goodbye (signed); one that dies
  stops counting when its key expires or its sequence stops growing (:mod:`.peers`): ``STALENESS_BOUND_S``.
  A decision reads the last counts that arrived, then (reservation on) waits at most
  ``--state-reserve-ms`` for one atomic round trip that picks and reserves the slot.
- **Run-time changes.** An admin change (policy, routing reload, worker add/remove) is validated and
  applied locally first (so a change refused on one replica is published nowhere), then published on
  ``<ns>:admin``; every other replica applies the same change. Health transitions (a worker marked
  down or up by a replica's checker) are published the same way.
- **Outage** (Redis unreachable or refusing; garbage in a key is not one: :mod:`.reads`): each replica
  routes on its local counts alone (the remote counts are dropped), logs it once, shares again by itself
  when Redis answers. No request fails because of Redis.
Decision logs stay per replica. :class:`LocalState` is the single-process default (nothing shared).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Protocol

from eldr_cli.proxy.replicas.auth import REASONS, Envelope
from eldr_cli.proxy.replicas.channels import HEARTBEAT_S, ChannelsMixin
from eldr_cli.proxy.replicas.configsync import CONFIG_TTL_MS, MAX_CONFIG_BYTES, ZERO, ConfigSync, Version, parse_version
from eldr_cli.proxy.replicas.conn import StateConn
from eldr_cli.proxy.replicas.counts import parse_counts, sum_counts
from eldr_cli.proxy.replicas.peers import Peers
from eldr_cli.proxy.replicas.reads import (
    MAX_VALUE_BYTES,
    NEW_NAMES_BUDGET,
    check_reserved,
    outage_kind,
    read_heartbeats,
    replica_name,
)
from eldr_cli.proxy.replicas.reserve import Reserver

log = logging.getLogger("eldr.proxy.state")

COALESCE_S = 0.01  # count changes within 10 ms go out as one message
TTL_MS = 1200
STALENESS_BOUND_S = TTL_MS / 1000 + HEARTBEAT_S  # 1.3 s: TTL + one heartbeat
MAX_REPLICAS = 256  # names read per heartbeat (the registry set is writable by anyone with Redis access)


class StateHost(Protocol):
    """What a shared state needs from the proxy app (``ProxyApp`` implements it)."""

    def all_workers(self) -> list[Any]: ...

    def local_vectors(self) -> dict[str, dict[str, list[int]]]: ...

    def remote_vectors_changed(self) -> None: ...

    def apply_remote_change(self, action: str, body: dict[str, Any]) -> None: ...

    def current_config(self) -> dict[str, Any]: ...

    def adopt_config(self, config: dict[str, Any]) -> None: ...


class LocalState:
    """One process, nothing shared: the embedded default."""

    kind = "local"

    def __init__(self) -> None:
        self.replica_id = uuid.uuid4().hex[:8]
        self.errors = 0
        self.outages = 0
        self.in_outage = False
        self.outage_kind: str | None = None  # "unreachable" or "refusing" while in_outage
        self.local_vectors: dict[str, dict[str, list[int]]] = {}  # name -> worker id -> vector
        self.env: Envelope | None = None
        self.reserver: Reserver | None = None  # atomic select-and-reserve (Redis only, eldr_cli.proxy.replicas.reserve)

    @property
    def rejected(self) -> dict[str, int]:
        return self.env.rejected if self.env is not None else dict.fromkeys(REASONS, 0)

    def wrong_key(self) -> dict[str, Any] | None:
        """Senders signing with another key in the last minute, as a count and a hash (None: no key)."""
        return self.env.wrong_key_view() if self.env is not None else None

    def release(self, request: Any) -> None:
        """Give ``request.reserved`` (its reserved decode slot) back, once: its decode leg ended."""
        if request.reserved is not None and self.reserver is not None:
            self.reserver.release(request.reserved)
        request.reserved = None

    def set_local_vectors(self, name: str, vectors: dict[str, list[int]]) -> None:
        """This replica's per-worker integer vectors named ``name`` (``{worker id: [int, ...]}``), for a
        stateful policy; the other replicas see their sum in ``Worker.remote_vectors[name]``."""
        self.local_vectors[name] = vectors
        self.note_change()

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


class RedisState(ChannelsMixin, LocalState):
    """In-flight counts and run-time changes shared through one Redis server (see module doc)."""

    kind = "redis"

    def __init__(self, conn: StateConn, key: bytes, reserve_ms: float = 0.0) -> None:
        super().__init__()
        self.conn, self.reserve_s, self.ns = conn, reserve_ms / 1000, conn.namespace
        self.env = Envelope(key, self.ns, self.replica_id)
        self.configs = ConfigSync(self.env, self.ns)
        self._peer_cv: dict[str, Version] = {}  # replica -> configuration version its signed heartbeat names
        self._replicas = 1
        self._last_sync = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._host: StateHost | None = None
        self._redis: Any = None
        self._channel = f"{self.ns}:admin"
        self._counts_channel = f"{self.ns}:counts"
        # replica -> (sequence, counts, vectors): the newest verified state of each other replica
        self._others: dict[str, tuple[int, dict[str, int], dict[str, dict[str, list[int]]]]] = {}
        self.peers = Peers(STALENESS_BOUND_S)  # alive = its sequence grew lately, on this replica's clock
        self._flush_scheduled = False
        self._bad_beat_logged = float("-inf")
        self._last_flush = float("-inf")  # loop time of the last counts message

    def _key(self, replica: str) -> str:
        return f"{self.ns}:inflight:{replica}"  # its heartbeat (signed counts), with a TTL

    @property
    def live_replicas(self) -> int:
        return self._replicas

    def sync_age_s(self) -> float:
        return time.monotonic() - self._last_sync

    async def start(self, host: StateHost) -> None:
        import redis.asyncio as aioredis

        self._host = host
        self.configs.joined_ms = int(time.time() * 1000)
        self._redis = aioredis.from_url(self.conn.url, **self.conn.client_kwargs())
        if self.reserve_s > 0:
            env = self.env
            assert env is not None
            self.reserver = Reserver(self._redis, self.ns, self.replica_id, self.reserve_s,
                                     peers=lambda: {o: c for o, (_, c, _) in self._others.items()},
                                     on_ignored=lambda n: env.reject("reservation_range", n=n))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat_loop()), loop.create_task(self._subscribe_loop())]
        log.info("shared state", extra={"event": "state", "state": "redis", "replica": self.replica_id,
                                        "namespace": self.ns, "staleness_bound_s": STALENESS_BOUND_S})

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self.reserver is not None:
            await self.reserver.stop()
        if self._redis is not None:
            await self._say_goodbye(self._key(self.replica_id), TTL_MS, self.replica_id)  # a crash: until the TTL
            try:
                await self._redis.aclose()
            except Exception:
                pass
            self._redis = None

    # -- counts ---------------------------------------------------------------------------------
    def _sealed_counts(self) -> bytes:
        """This replica's counts (and vectors, when a policy keeps some) as one signed message."""
        assert self.env is not None and self._host is not None
        workers = self._host.all_workers()
        payload: dict[str, Any] = {"c": {f"{w.role}|{w.url}": w.inflight for w in workers},
                                   "cv": list(self.configs.version)}
        local = {**self.local_vectors, **self._host.local_vectors()}
        if local:
            keys = {w.id: f"{w.role}|{w.url}" for w in workers}
            payload["v"] = {name: {keys[wid]: vec for wid, vec in vecs.items() if wid in keys}
                            for name, vecs in local.items()}
        return self.env.seal("counts", payload)

    def _accept_counts(self, data: bytes | str, replica: str | None = None) -> str | None:
        """Verify a counts message (or a heartbeat value read from ``replica``'s key); keep it if it
        is newer than what we have. Returns its origin when it verified."""
        assert self.env is not None
        msg = self.env.open(data, ("counts", "bye"))
        if msg is None:
            return None
        if replica is not None and msg.origin != replica:
            self.env.reject("malformed", origin=msg.origin)  # a valid value copied under another name
            return None
        if self.peers.ended(msg.origin):  # after its goodbye (read again from its key: no replay), a replay
            if msg.kind != "bye":
                self.env.reject("ended", origin=msg.origin)
            return None
        if msg.kind == "bye":
            self._gone(msg.origin)
            return None
        try:
            counts, vectors = parse_counts(msg.payload)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.env.reject("malformed", origin=msg.origin)
            return None
        if self.peers.grew(msg.origin, msg.seq):  # news (a replay or an older message is not: it keeps nothing)
            cv = parse_version(msg.payload.get("cv"))
            if cv is not None:
                self._peer_cv[msg.origin] = cv
            self._others[msg.origin] = (msg.seq, counts, vectors)
        return msg.origin

    def _gone(self, origin: str) -> None:
        """``origin`` said goodbye (a clean stop): it and its counts leave the sums now."""
        self.peers.end(origin)
        self._peer_cv.pop(origin, None)
        if self._others.pop(origin, None) is not None:
            self._replicas = max(1, self._replicas - 1)
        self._apply_remote()

    async def sync_once(self) -> None:
        """Publish this replica's counts and read the others' (one heartbeat). Every read is tolerant
        (:mod:`eldr_cli.proxy.replicas.reads`): a bad key or member is skipped, counted and cleared."""
        assert self._host is not None and self._redis is not None and self.env is not None
        key, reg = self._key(self.replica_id), f"{self.ns}:replicas"
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(key, self._sealed_counts(), px=TTL_MS).sadd(reg, self.replica_id).srandmember(reg, MAX_REPLICAS)
        pipe.getrange(self.configs.key, 0, MAX_CONFIG_BYTES).pexpire(self.configs.key, CONFIG_TTL_MS)
        res = await pipe.execute(raise_on_error=False)
        if isinstance(res[0], Exception):
            raise res[0]  # our own key cannot be written: Redis refuses us (the outage path)
        bad_members: list[Any] = []
        sample: list[Any] = []
        if isinstance(res[1], Exception) or isinstance(res[2], Exception):
            self.env.reject("wrong_type")  # the registry is not a set: replaced (we know the others anyway)
            await self._redis.delete(reg)
        else:
            sample = list(res[2])
        names = dict.fromkeys(self._others)  # verified replicas first: a flood of fake names cannot hide them
        for m in sample:
            name = replica_name(m)
            if name is None:
                self.env.reject("malformed")
                bad_members.append(m)
            elif name != self.replica_id and len(names) < 2 * MAX_REPLICAS:
                names[name] = None
        values = await read_heartbeats(self._redis, [self._key(o) for o in names if o in self._others],
                                       [self._key(o) for o in names if o not in self._others],
                                       MAX_VALUE_BYTES, NEW_NAMES_BUDGET)
        live = set()
        for o in names:
            v = values.get(self._key(o))
            if v is None:
                continue  # over this heartbeat's budget: read later
            if isinstance(v, bytes) and v and self._accept_counts(v, replica=o) == o and self.peers.alive(o):
                live.add(o)
                continue
            if isinstance(v, Exception):  # a wrong type or an oversized value under a replica's name
                self.env.reject("oversized" if isinstance(v, ValueError) else "wrong_type")
            bad_members.append(o)  # expired, gone, silent (no news), garbage or unverified: off the registry
        if bad_members:
            await self._redis.srem(reg, *bad_members)
        if int(time.monotonic()) != int(self._last_sync):  # ~1/s
            self.peers.forget_old()
            if self.reserver is not None:
                await check_reserved(self._redis, self.reserver, self.env)
        self._others = {o: st for o, st in self._others.items() if o in live}
        self._peer_cv = {o: v for o, v in self._peer_cv.items() if o in live}
        self.configs.peer_max = max(self._peer_cv.values(), default=ZERO)
        await self.configs.sync(self._redis, self._host, res[3])
        self._apply_remote()
        self._replicas = 1 + len(live)
        self._last_sync = time.monotonic()
        if self.in_outage:
            self.in_outage, self.outage_kind = False, None
            log.warning("shared state back: Redis answers again", extra={"event": "state", "to": "shared"})

    def _apply_remote(self) -> None:
        remote, vectors = sum_counts([(c, v) for _, c, v in self._others.values()])
        if self._host is not None:
            changed = False
            for w in self._host.all_workers():
                k = f"{w.role}|{w.url}"
                w.remote_inflight = remote.get(k, 0)
                if vectors or w.remote_vectors:  # nothing to build while no policy keeps vectors
                    w.remote_vectors = {name: acc[k] for name, acc in vectors.items() if k in acc}
                    changed = True
            if changed:
                self._host.remote_vectors_changed()

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
        self._spawn_publish(self._sealed_counts(), self._counts_channel)

    def _on_counts(self, data: bytes) -> None:
        if len(data) > MAX_VALUE_BYTES:
            assert self.env is not None
            self.env.reject("oversized")
            return
        if self._accept_counts(data) is not None:
            self._apply_remote()

    def _failed(self, e: BaseException, *, outage: bool = True) -> None:
        """A failed Redis operation. Only the heartbeat decides that Redis is unreachable or refusing this
        replica (``outage``): a publish or subscription that fails around the same time is the same outage,
        counted once. An error about one key's content is no outage: sharing goes on."""
        self.errors += 1
        kind = outage_kind(e) if outage else None
        if kind is None:
            if outage and time.monotonic() - self._bad_beat_logged >= 60:  # at most once a minute
                self._bad_beat_logged = time.monotonic()
                log.warning("shared state: a heartbeat failed on bad content; sharing goes on",
                            extra={"event": "state", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            return
        if not self.in_outage:
            self.in_outage, self.outage_kind = True, kind
            self.outages += 1
            what = "unreachable" if kind == "unreachable" else "refuses this replica (password, ACL or state)"
            log.warning(f"Redis {what}: routing on this replica's counts alone until it answers again",
                        extra={"event": "state", "to": "local", "outage": kind,
                               "error": f"{type(e).__name__}: {str(e)[:200]}"})
        self.outage_kind = kind  # the latest says it best (a dropped connection, then a refused password)
        self._others = {}  # stale counts of other replicas would mislead the band
        self._apply_remote()
        self._replicas = 1

    async def _beat(self) -> Exception | None:
        """One heartbeat, its failure returned (not raised: a stop during it leaves no unretrieved error)."""
        try:
            await self.sync_once()
        except Exception as e:
            return e
        return None

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                err = await asyncio.wait_for(self._beat(), timeout=1.0)
                if err is not None:
                    raise err
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down, refused password, timeouts, protocol errors: local routing
                self._failed(e)
            await asyncio.sleep(HEARTBEAT_S)
