"""Atomic select-and-reserve of a decode slot in Redis: the cure for the herd of replicas.

Replicas that read the same stale loads pick the same "least loaded" decoder: with 4 replicas behind
one port and bursts of arrivals, the in-flight spread across decoders measured 3.5x that of one proxy
(``benchmarks/bench_state.py``). So after the policy has decided locally, a replica asks Redis, in one
round trip (a Lua script, atomic), to pick the candidate with the fewest reserved slots over all
replicas and to reserve it by the one re-ranking rule eldr-live decides with
(:func:`eldr_cli.routing.policies.rerank`, the candidates in its tie order: among those whose slots are
within the slack of the least, the least predicted cost corrected by its growth for each slot the decision's
loads did not see, ties to the fewest slots, then the first in order; a policy without costs: the first in
order within the slack; a test checks the script against the function); the slot is released when
the decode leg ends. If Redis has not answered within the deadline (``--state-reserve-ms``, default
50), the local decision stands, and the late answer's slot is moved to the worker actually used (so the
counts in Redis stay complete).

The load cap is the policy's (``Ranking.slack``; eldr-live: ``max(2, ceil(0.25 x mean))``), enforced here on
Redis's exact counts. The reservation counts in Redis are not signed (Lua cannot check a tag without the key),
so they only choose *among* candidates the replica picked from signed data: the policy's candidates (ELDR: the
locality band; eldr-live: every decoder in its tie order; JSQ: the healthy pool), narrowed to the
workers whose signed load is within the policy's slack plus ``TRUST_MARGIN`` of the least loaded; the
decision's own worker always stays a candidate (a margin must never drop the policy's own choice).
Forged reservations can therefore move a choice only inside that set. And the script reads only the
fields it needs (``HMGET``: this replica's and those of the replicas whose *signed* heartbeat verified at
the last beat, for each candidate), counts another replica's field up to its signed in-flight there plus
``TRUST_MARGIN`` and its own up to the slots it holds there plus its reservations on their way (``Reserver.held``:
a forged value in a replica's own field moves nothing), counts a value only in ``0..MAX_IN_FLIGHT`` (integers; ``nan``,
``inf``, negatives and text are ignored and counted: ``eldr_proxy_state_rejected_total{reason=
"reservation_range"}``); every other field is removed about once a second (a crash does not leak slots
for long, and a bare ``inflight:<name>`` key keeps nothing alive).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from eldr_cli.proxy.workers import WorkerPool
    from eldr_cli.routing import Decision
    from eldr_cli.routing.router import Offer

log = logging.getLogger("eldr.proxy.state")

TRUST_MARGIN = 4  # candidates: signed load <= least signed load + the policy's slack + TRUST_MARGIN
MAX_IN_FLIGHT = 1024  # a replica's reserved slots on one worker (its connection cap): more is forged
RESULTS = ("ok", "timeout", "error", "skipped", "departed")  # departed: the answer named a worker that left

# the one re-ranking rule in Redis: checked against eldr_cli.routing.policies.rerank (tests/test_rerank_rule.py)
SELECT = """
local slack = tonumber(ARGV[2]) or 0
local nrep, ncand, maxv = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local r0, c0 = 6, 6 + nrep
local k0 = c0 + ncand
local o0 = k0 + nrep * ncand
local load, bad, least = {}, 0, nil
for j = 1, ncand do
  local f = {ARGV[1] .. '|' .. ARGV[c0 + j - 1]}
  for i = 1, nrep do f[i + 1] = ARGV[r0 + i - 1] .. '|' .. ARGV[c0 + j - 1] end
  local vals = redis.call('HMGET', KEYS[1], unpack(f))
  local n = 0
  for i = 1, nrep + 1 do
    local v = vals[i]
    if v then
      local x = tonumber(v)
      if x and x == x and x >= 0 and x <= maxv and x == math.floor(x) then
        if i > 1 then x = math.min(x, tonumber(ARGV[k0 + (i - 2) * ncand + j - 1]))
        else x = math.min(x, tonumber(ARGV[o0 + j - 1])) end
        n = n + x
      else
        bad = bad + 1
      end
    end
  end
  load[j] = n
  if least == nil or n < least then least = n end
end
local e0 = o0 + ncand
-- the one re-ranking rule (eldr_cli.routing.policies.rerank, checked against this script): among the candidates
-- within the slack of the least, the least cost + (exact - seen) * growth, costs within tie of it are ties, then
-- the fewest slots, then the first in order (a rule without costs: cost = position in order, tie 0)
local tie, adj, lo = tonumber(ARGV[e0]), {}, nil
for j = 1, ncand do
  if load[j] <= least + slack then
    local c, g, s = tonumber(ARGV[e0 + j]), tonumber(ARGV[e0 + ncand + j]), tonumber(ARGV[e0 + 2 * ncand + j])
    adj[j] = c + (load[j] - s) * g
    if lo == nil or adj[j] < lo then lo = adj[j] end
  end
end
local lim
if lo >= 0 then lim = lo * (1 + tie) else lim = lo * (1 - tie) end
local best = nil
for j = 1, ncand do
  if adj[j] and adj[j] <= lim and (best == nil or load[j] < load[best]) then best = j end
end
local own = ARGV[1] .. '|' .. ARGV[c0 + best - 1]
local x = tonumber(redis.call('HGET', KEYS[1], own) or '0')
if x and x == x and x >= 0 and x < maxv and x == math.floor(x) then
  redis.call('HINCRBY', KEYS[1], own, 1)
else
  redis.call('HSET', KEYS[1], own, 1)
end
return {best - 1, bad}
"""
_RELEASE = """
local v = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if v <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return v
"""
_MOVE = """
local v = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if v <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
"""
_CLEANUP = """
local live = {}
for i = 1, #ARGV do live[ARGV[i]] = true end
local n = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  local p = string.find(f, '|', 1, true)
  if not p or not live[string.sub(f, 1, p - 1)] then
    redis.call('HDEL', KEYS[1], f)
    n = n + 1
  end
end
return n
"""


class Costs(NamedTuple):
    """The rule's inputs for the reservation, per candidate: predicted cost, its growth per slot the decision's
    loads left out, those loads (``seen``); ``tie``: costs within this fraction are ties (see
    :func:`eldr_cli.routing.policies.rerank`). A rule without costs: :meth:`in_order`."""

    cost: list[float]
    growth: list[float]
    seen: list[int]
    tie: float

    @classmethod
    def in_order(cls, n: int) -> Costs:
        """The rule without costs over ``n`` candidates: each one's position is its cost (the first in order
        within the slack)."""
        return cls([float(j) for j in range(n)], [0.0] * n, [0] * n, 0.0)


def select_args(replica_id: str, slack: int, reps: Sequence[str], cands: Sequence[str], caps: Sequence[int],
                own: Sequence[int], costs: Costs | None = None) -> list[Any]:
    """The select script's ARGV: this replica, the slack, the peers ``reps`` whose fields count, the candidate
    worker keys (in the rule's tie order), each peer's cap per candidate (peer-major), this replica's own cap per
    candidate, then the rule's ``costs`` (default :meth:`Costs.in_order`) as exact decimal text."""
    costs = Costs.in_order(len(cands)) if costs is None else costs
    return [replica_id, slack, len(reps), len(cands), MAX_IN_FLIGHT, *reps, *cands, *caps, *own,
            repr(float(costs.tie)), *map(repr, map(float, costs.cost)), *map(repr, map(float, costs.growth)),
            *map(int, costs.seen)]


@dataclass
class Slot:
    """A reserved decode slot: the worker key, and the late reservation still on its way (if any)."""

    key: str
    pending: asyncio.Task[Any] | None = None


class Reserver:
    """The reservation side of :class:`eldr_cli.proxy.replicas.shared.RedisState` (one per replica)."""

    def __init__(self, redis: Any, ns: str, replica_id: str, deadline_s: float,
                 peers: Callable[[], dict[str, dict[str, int]]] = dict,
                 on_ignored: Callable[[int], None] | None = None):
        self.key, self.replica_id, self.deadline_s = f"{ns}:reserved", replica_id, deadline_s
        self._peers = peers  # the other replicas whose signed state verified: {replica: {worker key: in-flight}}
        self._on_ignored = on_ignored  # called with the number of fields outside 0..MAX_IN_FLIGHT seen
        self._redis = redis
        self._select = redis.register_script(SELECT)
        self._release = redis.register_script(_RELEASE)
        self._cleanup = redis.register_script(_CLEANUP)
        self._move = redis.register_script(_MOVE)
        self.results: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self._bg: set[asyncio.Task[Any]] = set()
        # this replica's own slots as it knows them (landed reservations not yet given back, per worker key) and
        # its reservations still on their way: its own field in Redis counts at most their sum (more is forged)
        self.held: dict[str, int] = {}
        self._pending = 0

    async def choose(self, cands: Sequence[str], slack: int = 0,
                     costs: Costs | None = None) -> tuple[int | None, asyncio.Task[Any] | None]:
        """(index into ``cands`` of the reserved worker, None) in time: :func:`eldr_cli.routing.policies.rerank` on
        the slots over all replicas, ``cands`` in its tie order, with ``costs`` (default :meth:`Costs.in_order`:
        the first within ``slack`` of the least); (None, the pending reservation) when Redis is late (hand it to
        :meth:`late_slot` with the worker used instead); (None, None) on errors."""
        peers = self._peers()
        reps = sorted(peers)  # another replica's slots on a worker count up to its signed in-flight + TRUST_MARGIN
        caps = [peers[r].get(k, 0) + TRUST_MARGIN for r in reps for k in cands]
        self._pending += 1
        own = [self.held.get(k, 0) + self._pending for k in cands]
        task = asyncio.get_running_loop().create_task(self._select(
            keys=[self.key], args=select_args(self.replica_id, slack, reps, cands, caps, own, costs)))
        task.add_done_callback(lambda t: self._landed(t, cands))
        done, _ = await asyncio.wait({task}, timeout=self.deadline_s)
        if not done:
            self.results["timeout"] += 1
            return None, task
        try:
            i, ignored = (int(x) for x in task.result())
        except Exception as e:  # noqa: BLE001 - Redis down or refusing: the local decision stands
            self.results["error"] += 1
            log.debug("reservation failed", extra={"event": "state", "error": str(e)})
            return None, None
        self.results["ok"] += 1
        if ignored and self._on_ignored is not None:
            self._on_ignored(ignored)
        return (i, None) if 0 <= i < len(cands) else (None, None)

    def _landed(self, task: asyncio.Task[Any], cands: Sequence[str]) -> None:
        """A reservation's answer arrived (in time or late): one fewer on its way, one more held if it reserved."""
        self._pending -= 1
        if task.cancelled() or task.exception() is not None:
            return
        i = int(task.result()[0])
        if 0 <= i < len(cands):
            self._hold(cands[i], 1)

    def _hold(self, key: str, n: int) -> None:
        v = self.held.get(key, 0) + n
        if v > 0:
            self.held[key] = v
        else:
            self.held.pop(key, None)

    def late_slot(self, task: asyncio.Task[Any], cands: Sequence[str], used: str) -> Slot:
        """The slot of ``used``, the worker chosen locally while the reservation was late: the late
        answer's slot is moved to it, so the counts in Redis stay those of the requests in flight."""
        return Slot(used, self._spawn(self._move_late(task, cands, used)))

    async def _move_late(self, task: asyncio.Task[Any], cands: Sequence[str], local: str) -> None:
        i = int((await task)[0])
        if cands[i] != local:
            self._hold(cands[i], -1)
            self._hold(local, 1)
            await self._move(keys=[self.key], args=[f"{self.replica_id}|{cands[i]}", f"{self.replica_id}|{local}"])

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._done)
        return task

    def release(self, slot: Slot) -> None:
        """Give the slot back (after its late reservation has landed, if it was late)."""
        self._spawn(self._release_after(slot))

    async def _release_after(self, slot: Slot) -> None:
        if slot.pending is not None:
            await asyncio.wait({slot.pending})
            if slot.pending.cancelled() or slot.pending.exception() is not None:
                return  # nothing landed: nothing to give back
        self._hold(slot.key, -1)
        await self._release(keys=[self.key], args=[f"{self.replica_id}|{slot.key}"])

    def _done(self, t: asyncio.Task[Any]) -> None:
        self._bg.discard(t)
        if not t.cancelled():
            t.exception()  # retrieved: a failed release is the outage path (fields expire with the replica)

    async def cleanup(self) -> None:
        """Drop the slots of every replica but this one and those whose signed heartbeat verified at the
        last beat (stopped, crashed, or a name only an attacker writes: a bare key is no heartbeat)."""
        await self._cleanup(keys=[self.key], args=[self.replica_id, *self._peers()])

    async def stop(self) -> None:
        for t in list(self._bg):
            t.cancel()
        try:  # a clean stop leaves no slots behind
            fields = [f for f in await self._redis.hkeys(self.key)
                      if (f.decode() if isinstance(f, bytes) else f).startswith(self.replica_id + "|")]
            if fields:
                await self._redis.hdel(self.key, *fields)
        except Exception:  # noqa: BLE001
            pass


async def reserve_decode(reserver: Reserver | None, offer: Offer | None, pool: WorkerPool, choice: Decision,
                         loads: Sequence[int], scrape_metrics: bool = False) -> tuple[Decision, Slot | None]:
    """The decision to follow after the router chose ``choice`` on ``loads`` (those the decision was made on: read
    now, they would hold the request itself on ``choice.worker`` and widen the candidates by one), and its reserved
    slot (None when nothing was reserved: no ``reserver`` (reservation off), no ``offer`` (a policy that does not
    reserve, or Redis out: counted as skipped), Redis down). ``pool``: the decode workers (their health, and the
    pool of now once the round trip is over); ``scrape_metrics``: a local decision reads the scraped loads."""
    rv = reserver
    if rv is None:
        return choice, None
    if offer is None:
        rv.results["skipped"] += 1
        return choice, None
    workers = pool.workers
    slack = offer.slack
    band = [j for j, k in enumerate(offer.order) if workers[k].healthy]
    if not band:
        return choice, None
    least = min(loads[offer.order[j]] for j in band)
    pos = [j for j in band if loads[offer.order[j]] <= least + slack + TRUST_MARGIN or offer.order[j] == choice.worker]
    cands = [workers[offer.order[j]] for j in pos]
    keys = [f"{w.role}|{w.url}" for w in cands]
    costs = None if offer.cost is None or offer.growth is None else Costs(
        [offer.cost[j] for j in pos], [offer.growth[j] for j in pos], [int(loads[offer.order[j]]) for j in pos],
        offer.tie)
    mine = workers[choice.worker]
    i, late = await rv.choose(keys, slack, costs)
    cur = pool.workers  # the round trip took time: the pool and the loads may have changed
    if i is not None and cands[i] in cur:
        return dataclasses.replace(choice, worker=cur.index(cands[i])), Slot(keys[i])
    if late is not None:  # decide locally now, on the loads of now (not those before the wait)
        up = [w for w in cands if w in cur] or [w for w in cur if w.healthy] or cur
        w = min(up, key=lambda w: w.load(scrape_metrics))
        return dataclasses.replace(choice, worker=cur.index(w)), rv.late_slot(late, keys, f"{w.role}|{w.url}")
    if i is not None:  # the answer names a worker that left the pool meanwhile: its slot back, decided locally
        rv.results["ok"] -= 1
        rv.results["departed"] += 1
        rv.release(Slot(keys[i]))
    if mine in cur:  # the local decision, on the pool of now (positions shift when a worker leaves)
        return dataclasses.replace(choice, worker=cur.index(mine)), None
    up = [w for w in cur if w.healthy] or cur
    return dataclasses.replace(choice, worker=cur.index(min(up, key=lambda w: w.load(scrape_metrics)))), None
