"""The hand-off of one request to a decode worker, as one object built from explicit parts.

:class:`Dispatcher` holds the decode router, the decode pool, the shared state's reservation (replicas), the
:class:`Recorder` (metrics and decision log) and the shadow policies, and for each request runs::

    decide -> hold -> reserve (replicas: the rule redone on Redis's exact counts) -> record -> notify the shadows

returning a :class:`DecisionRecord`, the decision as followed, whose :meth:`DecisionRecord.row` is the decision log's
row (``manifests/decision-log.v2.schema.json``, what `eldr report --decision-log` reads). The HTTP legs around
it are :mod:`eldr_cli.proxy.exchange`'s. The app builds one dispatcher at start and a new one on every admin swap
(policy, tau, routing artifact, decode pool); a request keeps the one it started with, so a swap mid-request does
not split one request's dispatch and finish. ``eldr serve-dynamo`` runs the same object over Dynamo's decode
instances (:mod:`eldr_cli.dynamo.router`); there the instances change without an admin, and the requests in flight
move into the new router (the decision each is held on: ``RequestContext.choice``), which is swapped into the one
dispatcher in place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from eldr_cli.handoff import SIGNATURE_KEY, WIRE_DTYPES, SignatureDecodeError, decode_counts, pop_signature
from eldr_cli.proxy.decisionlog import replay_fields
from eldr_cli.proxy.replicas.reserve import Reserver, reserve_decode
from eldr_cli.proxy.request import RequestContext, context_tokens
from eldr_cli.proxy.workers import WorkerPool
from eldr_cli.routing import Decision, DecodeRouter

if TYPE_CHECKING:
    from eldr_cli.proxy.decisionlog import DecisionLog
    from eldr_cli.proxy.drift import DriftWatch
    from eldr_cli.proxy.metrics import ProxyMetrics
    from eldr_cli.proxy.shadow import ShadowSet


class Reservations(Protocol):
    """What the dispatch needs of the shared state (:mod:`eldr_cli.proxy.replicas.shared`): its reserver (None:
    nothing to reserve), whether Redis is out, and a note that this replica's in-flight counts changed."""

    reserver: Reserver | None
    in_outage: bool

    def note_change(self) -> None: ...


class Handoff(NamedTuple):
    """What the prefill answer hands over to the decision."""

    counts: Any                      # int [L, E] prefill counts (None: missing, malformed or not needed)
    signature: str                   # "ok" | "missing" | "malformed" | "unused"
    tokens: int | None               # context tokens the request will hold on its decoder
    replay: dict[str, Any] | None    # the decision log's replay fields (None: not logged)


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One decode decision as followed: ``decision.worker`` is the worker used (after a reservation's move),
    ``worker`` its id, ``first`` the id of the ranking's first choice; ``loads`` as the policy saw them."""

    request_id: str
    policy: str
    decision: Decision
    worker: str
    first: str
    signature: str
    loads: tuple[int, ...]
    tau: float
    domain: str | None
    seconds: float
    ts: float
    replay: Mapping[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """The decision log's row (``manifests/decision-log.v2.schema.json``; the replay fields when logged)."""
        d = self.decision
        row: dict[str, Any] = {"ts": self.ts, "request_id": self.request_id, "policy": self.policy, "tau": self.tau,
               "signature": self.signature,
               "similarities": None if d.similarities is None else d.similarities.tolist(),
               "band": None if d.band is None else d.band.tolist(),
               "predicted_ms": None if d.predicted_ms is None else [round(float(x), 4) for x in d.predicted_ms],
               "loads": list(self.loads), "chosen": d.worker, "worker": self.worker, "first": self.first,
               "domain": self.domain, "decision_us": round(self.seconds * 1e6, 2)}
        return row if self.replay is None else {**row, **self.replay}


class Recorder:
    """Where decisions are recorded: the proxy's metrics, its decision log (None: off) and the drift watch (None:
    off); ``routing_path`` and ``scrape_metrics`` fill the log's replay fields."""

    def __init__(self, metrics: ProxyMetrics, log: DecisionLog | None = None, drift: DriftWatch | None = None,
                 routing_path: str | None = None, scrape_metrics: bool = False):
        self.metrics, self.log, self.drift = metrics, log, drift
        self.routing_path, self.scrape_metrics = routing_path, scrape_metrics

    def observe(self, t0_perf: float, answer: dict[str, Any], body: dict[str, Any], ktp: dict[str, Any] | None,
                pool: WorkerPool) -> dict[str, Any] | None:
        """At the hand-off, before the signature is popped: the replay fields when the decision log records them
        (else None)."""
        if self.log is None or not self.log.replay:
            return None
        enc = ktp.get(SIGNATURE_KEY) if ktp is not None else None
        row = replay_fields(t0_perf, answer, body, enc, self.routing_path)
        if self.scrape_metrics:  # the decoders' scraped TPOT: what `eldr report --decision-log` holds the model to
            row["decoders_tpot_ms"] = [None if w.scraped_tpot_ms is None else round(w.scraped_tpot_ms, 4)
                                       for w in pool.workers]
        return row

    def watch(self, signature: Any) -> None:
        """Queue a handed-off signature for the drift watch (if on): (routing model, its Eq. 2 cells, the nearest
        prototype) when the decision computed them, its decoded counts when the hand-off decoded them (neither
        computed twice), else as it arrived."""
        if self.drift is not None:
            self.drift.observe(signature)

    def signature(self, state: str) -> None:
        """A hand-off without a usable signature (``missing`` or ``malformed``), counted."""
        self.metrics.child(self.metrics.signature_missing, state).inc()

    def record(self, rec: DecisionRecord) -> None:
        """The metrics of one decision as followed."""
        m, d = self.metrics, rec.decision
        m.child(m.decision_seconds, rec.policy).observe(rec.seconds)
        if d.band is not None:
            m.band_size.observe(len(d.band))
        m.child(m.decisions, rec.policy, rec.worker).inc()
        if d.first != d.worker:
            m.child(m.moved, rec.policy).inc()


class Dispatcher:
    """The hand-off of one proxy: built from its parts (see the module's docstring), rebuilt on an admin swap."""

    __slots__ = ("router", "pool", "shared", "recorder", "shadows", "tau", "scrape_metrics")

    def __init__(self, router: DecodeRouter, pool: WorkerPool, shared: Reservations, recorder: Recorder,
                 shadows: ShadowSet | None = None, *, tau: float = float("nan"), scrape_metrics: bool = False):
        self.router, self.pool, self.shared, self.recorder, self.shadows = router, pool, shared, recorder, shadows
        self.tau, self.scrape_metrics = tau, scrape_metrics
        if router.needs_signature or shadows is not None:  # the counts arrive in the wire's widths (handoff)
            from eldr_cli.routing.compiled import warm

            warm(WIRE_DTYPES, read_only=True)

    def handoff(self, t0_perf: float, answer: dict[str, Any], body: dict[str, Any],
                ktp: dict[str, Any] | None) -> Handoff:
        """What the prefill ``answer`` hands over (its signature is popped from ``ktp``, the kv_transfer_params
        the decode leg forwards)."""
        rec = self.recorder
        replay = rec.observe(t0_perf, answer, body, ktp, self.pool)  # the log's replay fields
        enc = pop_signature(ktp)
        tokens = context_tokens(answer, body)
        if enc is None:
            rec.signature("missing")
            return Handoff(None, "missing", tokens, replay)
        if not self.router.needs_signature and self.shadows is None:
            rec.watch(enc)
            return Handoff(None, "unused", tokens, replay)
        try:
            counts = decode_counts(enc, widen=False)  # the wire's width: the compiled loops read it as is
        except SignatureDecodeError:
            rec.watch(enc)
            rec.signature("malformed")
            return Handoff(None, "malformed", tokens, replay)
        return Handoff(counts, "ok", tokens, replay)  # queued for the drift watch once decided (dispatch)

    async def dispatch(self, ctx: RequestContext, h: Handoff) -> DecisionRecord:
        """decide -> hold -> reserve -> record -> notify the shadows. The request is held (in the router's live set
        and its worker's in-flight count) from the decision on, whatever awaits follow; :meth:`release` ends it."""
        router, pool = self.router, self.pool
        t0 = time.perf_counter()
        loads = pool.loads(self.scrape_metrics)
        d = router.decide(h.counts, loads, domain=ctx.domain, healthy=[w.healthy for w in pool.workers],
                          tokens=h.tokens)
        dt = time.perf_counter() - t0
        self._hold(ctx, d)  # before anything awaits
        if h.signature == "ok":  # the drift watch scores the Eq. 2 cells the decision computed (eldr-live's detail)
            cells = getattr(d.detail, "cells", None)  # ... and the prototype it found nearest
            self.recorder.watch(h.counts if cells is None else (router.model, cells, d.detail.prototype))
        sh = self.shared
        offer = None if sh.reserver is None or sh.in_outage else router.reservation(d, loads)
        # replicas: one atomic slot in Redis; a move it makes is one more dispatch (the live set follows)
        d, ctx.reserved = await reserve_decode(sh.reserver, offer, pool, d, loads, self.scrape_metrics)
        if d.worker != ctx.decode_index:
            self.release(ctx)
            self._hold(ctx, d)
        rec = self._record(ctx, d, h, loads, dt)
        self._notify(ctx, rec, h)
        return rec

    def _record(self, ctx: RequestContext, d: Decision, h: Handoff, loads: list[int], dt: float) -> DecisionRecord:
        sig = h.signature
        if d.signature == "malformed" and sig == "ok":  # decoded, but not of the artifact's shape
            sig = "malformed"
            self.recorder.signature(sig)
        workers = self.pool.workers
        wid = workers[d.worker].id
        rec = DecisionRecord(ctx.rid, self.router.name, d, wid, workers[d.first].id if 0 <= d.first < len(workers)
                             else wid, sig, tuple(loads), self.tau, ctx.domain, dt, time.time(), h.replay)
        ctx.policy = rec.policy
        self.recorder.record(rec)
        return rec

    def _notify(self, ctx: RequestContext, rec: DecisionRecord, h: Handoff) -> None:
        """The decision log's row, after the shadows (if any) decided right after this request was dispatched."""
        dlog = self.recorder.log
        row = None if dlog is None else rec.row()
        if self.shadows is not None:
            self.shadows.later(ctx.rid, h.counts, rec.decision, ctx.domain, [w.healthy for w in self.pool.workers],
                               h.tokens, row, dlog)
        elif row is not None and dlog is not None:
            dlog.write(row)

    def retry(self, ctx: RequestContext, h: Handoff, tried: set[str]) -> Decision | None:
        """The decode leg could not connect: the same router decides again among the healthy workers not ``tried``
        (the request moves there: finished on the old one, dispatched on the new one); None when none is left or
        two were tried."""
        up = [w.healthy and w.id not in tried for w in self.pool.workers]
        if len(tried) >= 2 or not any(up):
            return None
        self.release(ctx)  # no await from here to the new dispatch
        d = self.router.decide(h.counts, self.pool.loads(self.scrape_metrics), domain=ctx.domain, healthy=up,
                               tokens=h.tokens)
        self._hold(ctx, d)
        return d

    def _hold(self, ctx: RequestContext, choice: Decision) -> None:
        """The request is on ``choice.worker`` from now on: in the router's live set and in that worker's in-flight
        count (which the next decisions' loads read), whatever awaits follow."""
        self.router.on_dispatch(choice, ctx.rid)
        w = self.pool.workers[choice.worker]
        w.inflight += 1
        ctx.decode_index, ctx.held, ctx.choice = choice.worker, w, choice
        self.shared.note_change()

    def release(self, ctx: RequestContext) -> None:
        """The request left the worker :meth:`_hold` put it on (finished, failed, cancelled or moved)."""
        if ctx.held is None or ctx.decode_index is None:
            return
        self.router.on_finish(ctx.decode_index, ctx.rid)
        ctx.held.inflight -= 1
        ctx.held, ctx.decode_index, ctx.choice = None, None, None
        self.shared.note_change()

    def finish(self, rid: str) -> None:
        """Request ``rid`` ended (whatever its outcome, dispatched or not): its shadow placements end with it."""
        if self.shadows is not None:
            self.shadows.finish_later(rid)
