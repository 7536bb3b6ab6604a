"""The decision of eldr's Dynamo decode router, without Dynamo: which decode *instance* a request goes to.

:class:`InstanceRouter` is the router's state: the decode instances it discovers as the decode pool of the
proxy's hand-off (:class:`eldr_cli.proxy.workers.WorkerPool`: one ``Worker`` per instance, ``id`` the instance
id, ``url`` ``dynamo://<id>``, in sorted order: the slots), one eldr :class:`~eldr_cli.routing.DecodeRouter` over
those slots (from ``make_router``, the one factory), and the proxy's :class:`~eldr_cli.proxy.dispatch.Dispatcher`
built from them, which runs each request's hand-off as it does in ``serve-proxy``: signature popped and decoded,
decide -> hold -> reserve (replicas) -> record (the proxy's metrics and decision-log rows) -> shadow policies.
There is no second copy of any of these here.

When the set of instances changes the router is built anew over the new slots, swapped into the same dispatcher,
and the requests still in flight on the instances that stayed are dispatched into it again (the decision each is
held on: ``RequestContext.choice``), so a policy's live sets survive an instance that joins or leaves. (The proxy's
admin swap, by contrast, gives new requests a new dispatcher and lets the old ones finish on the old router.)

The signature is the one eldr's vLLM plugin writes: ``prefill_result.disaggregated_params.kv_transfer_params
["eldr_signature"]`` in the request Dynamo's frontend hands its decode tier. Dynamo's request is shown to the
dispatcher in the proxy's shapes (:func:`proxy_shapes`: the prompt's token count and the output budget). A
request without a usable signature is decided as ``serve-proxy`` decides it (the policy without a signature:
JSQ for eldr and the load balancers, eldr-live's mean prototype on the loads) and counted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from eldr_cli.errors import EldrError
from eldr_cli.proxy.dispatch import DecisionRecord, Dispatcher, Handoff, Recorder
from eldr_cli.proxy.metrics import ProxyMetrics
from eldr_cli.proxy.request import RequestContext
from eldr_cli.proxy.workers import Worker, WorkerPool
from eldr_cli.routing import DecodeRouter, RoutingModel, make_router
from eldr_cli.routing.registry import check_policy

if TYPE_CHECKING:
    from eldr_cli.proxy.decisionlog import DecisionLog
    from eldr_cli.proxy.replicas.shared import LocalState
    from eldr_cli.proxy.shadow import ShadowSet


class NoDecodeInstance(EldrError):
    """No decode instance is registered at the decode endpoint (the request fails with this message)."""


def kv_transfer_params(request: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill's ``kv_transfer_params`` inside a Dynamo decode request (None when it has none)."""
    pr = request.get("prefill_result")
    dp = pr.get("disaggregated_params") if isinstance(pr, dict) else None
    kv = dp.get("kv_transfer_params") if isinstance(dp, dict) else None
    return kv if isinstance(kv, dict) else None


def proxy_shapes(request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Dynamo decode request as the proxy's hand-off reads a request: (the prefill answer's ``usage`` with the
    prompt's token count, the client body's ``max_tokens``), so that the context tokens are counted the one way
    (:func:`eldr_cli.proxy.request.context_tokens`)."""
    ids = request.get("token_ids")
    stop = request.get("stop_conditions")
    out = stop.get("max_tokens") if isinstance(stop, dict) else None
    answer = {"usage": {"prompt_tokens": len(ids)}} if isinstance(ids, list) else {}
    return answer, ({"max_tokens": out} if out is not None else {})


@dataclass
class Flight:
    """One request from its decision to the end of its stream: the proxy's request context (where it is held, its
    reserved slot), its hand-off (the decoded signature a retry decides on again) and its decision as recorded."""

    ctx: RequestContext
    handoff: Handoff
    record: DecisionRecord | None = None
    left: int | None = None   # the instance it was on, once that instance left mid-stream

    @property
    def rid(self) -> str:
        return self.ctx.rid

    @property
    def slot(self) -> int | None:
        """Its instance's slot now (None once the instance left or the request ended)."""
        return self.ctx.decode_index

    @property
    def instance_id(self) -> int | None:
        return int(self.ctx.held.id) if self.ctx.held is not None else self.left

    @property
    def signature(self) -> str:
        return self.record.signature if self.record is not None else self.handoff.signature


class InstanceRouter:
    """eldr's decode decision over the decode instances a Dynamo component discovers (see the module doc).

    It is the state the proxy's metrics and shadow policies read (:class:`eldr_cli.proxy.base.RouterState`) and the
    shared state's host (``all_workers``, ``local_vectors``, ``remote_vectors_changed``): each instance's
    ``inflight`` is this replica's, its ``remote_inflight`` the other replicas' when ``shared`` is Redis's."""

    def __init__(self, policy: str, *, model: RoutingModel | None = None, cost: Any = None,
                 tau: float | None = None, seed: int = 0, shared: LocalState | None = None,
                 log: DecisionLog | None = None, shadows: Sequence[str] = ()):
        from eldr_cli.proxy.replicas.shared import LocalState

        self.policy = check_policy(policy, servable=True)
        for name in shadows:
            check_policy(name, servable=True)
        self.model, self.cost, self.tau_override, self.seed = model, cost, tau, seed
        self.routing_path: str | None = None
        # fails here if its artifact cannot serve it (over as many instances as the artifact has centroids: eldr)
        self.router: DecodeRouter = self.make(policy, model.n_clusters if model is not None else 1, model, tau)
        self.shared: LocalState = shared if shared is not None else LocalState()
        self.prefill, self.decode = WorkerPool("prefill", []), WorkerPool("decode", [])
        self.instances: list[int] = []
        self.live: dict[str, Flight] = {}
        self.counts: Counter[str] = Counter()   # requests, signature_<state>, rebuilds, orphaned, retries
        self.dispatched: Counter[int] = Counter()
        self.metrics = ProxyMetrics(self)
        self.shadow_names = list(shadows)
        self.shadow: ShadowSet | None = None  # built with the first instances (a shadow needs a pool)
        self.dispatch = Dispatcher(self.router, self.decode, self.shared, Recorder(self.metrics), None,
                                   tau=self.tau_effective())
        self.log: DecisionLog | None = None
        if log is not None:
            self.attach_log(log)

    def attach_log(self, log: DecisionLog) -> None:
        """The decision log the dispatcher writes its rows to (and the metrics count)."""
        self.log = self.dispatch.recorder.log = log
        self.metrics.watch_decision_log(log)

    # -- what the metrics and the shadows read (eldr_cli.proxy.base.RouterState) ----------------------
    def make(self, name: str, n: int, model: RoutingModel | None, tau: float | None) -> DecodeRouter:
        return make_router(name, n, model=model, tau=tau, seed=self.seed, cost=self.cost)

    @property
    def in_progress(self) -> int:
        return len(self.live)

    @property
    def policy_name(self) -> str:
        return self.router.name

    def tau_effective(self) -> float:
        tau = self.router.tau if self.router.tau is not None else self.tau_override
        if tau is not None:
            return float(tau)
        return float(self.model.tau) if self.model is not None else float("nan")

    @property
    def slots(self) -> list[Worker]:
        return self.decode.workers

    @property
    def loads(self) -> list[int]:
        """In-flight requests per instance (slot order) over all replicas: this one's exact, the others' last seen."""
        return [w.load() for w in self.slots]

    # -- membership ---------------------------------------------------------------------------------
    def sync(self, instance_ids: Sequence[int]) -> bool:
        """Follow the discovered decode instances; True when they changed (the router was rebuilt)."""
        ids = sorted({int(i) for i in instance_ids})
        if ids == self.instances:
            return False
        kept = {int(w.id): w for w in self.slots}
        self.instances = ids
        self.decode.workers = [kept.get(i) or Worker(str(i), "decode", f"dynamo://{i}") for i in ids]
        self.counts["rebuilds"] += 1
        if ids:  # none: the requests in flight are orphaned below; the next instances build the router
            self.router = self.dispatch.router = self.make(self.policy, len(ids), self.model, self.tau_override)
            self.dispatch.tau = self.tau_effective()
            if self.shadow_names and self.shadow is None:
                self._build_shadows()
        slot_of = {iid: i for i, iid in enumerate(ids)}
        for rid, f in self.live.items():
            ctx = f.ctx
            if ctx.held is None or ctx.choice is None:
                continue
            slot = slot_of.get(int(ctx.held.id))
            if slot is None:  # its instance left mid-stream; its stream fails or ends there
                self.counts["orphaned"] += 1
                f.left, ctx.held, ctx.decode_index, ctx.choice = int(ctx.held.id), None, None, None
                continue
            ctx.decode_index, ctx.choice = slot, dataclasses.replace(ctx.choice, worker=slot)
            self.router.on_dispatch(ctx.choice, rid)
        self.remote_vectors_changed()
        if self.shadow is not None:
            self.shadow.follow()
        return True

    def _build_shadows(self) -> None:
        from eldr_cli.proxy.shadow import ShadowSet, register_shadow_metrics

        self.shadow = self.dispatch.shadows = ShadowSet(self, self.shadow_names)
        register_shadow_metrics(self.metrics.registry, self.shadow)

    # -- one request ----------------------------------------------------------------------------------
    async def choose(self, request: dict[str, Any], rid: str) -> Flight:
        """Decide ``request``'s decode instance with the proxy's dispatcher (its signature popped; held there, its
        slot reserved with several replicas, recorded, the shadows told) until :meth:`finish`."""
        if not self.instances:
            raise NoDecodeInstance("no decode instance is registered at the decode endpoint")
        if rid in self.live:
            raise EldrError(f"request id {rid!r} is already in flight at this router")
        ctx = RequestContext(rid=rid, endpoint="generate")
        answer, body = proxy_shapes(request)
        h = self.dispatch.handoff(ctx.t0, answer, body, kv_transfer_params(request))
        f = self.live[rid] = Flight(ctx, h)  # before the reservation awaits: a rebuild meanwhile moves it too
        try:
            f.record = await self.dispatch.dispatch(ctx, h)
        except BaseException:
            self.finish(f)
            raise
        self.counts["requests"] += 1
        self.counts[f"signature_{f.record.signature}"] += 1
        if f.instance_id is not None:
            self.dispatched[f.instance_id] += 1
        return f

    def again(self, f: Flight, tried: set[int]) -> Flight:
        """``f``'s instance failed before answering: its reserved slot back, and the same router decides again
        among the instances not ``tried``, on the same signature (:meth:`Dispatcher.retry`; counted under
        ``retries``)."""
        self.shared.release(f.ctx)
        d = self.dispatch.retry(f.ctx, f.handoff, {str(i) for i in tried})
        if d is None:
            raise NoDecodeInstance("no other decode instance is registered at the decode endpoint")
        self.counts["retries"] += 1
        self.metrics.child(self.metrics.retries, "decode").inc()
        if f.instance_id is not None:
            self.dispatched[f.instance_id] += 1
        return f

    def finish(self, f: Flight) -> None:
        """The request's stream ended (done, failed or cancelled): out of its instance's load and live set, its
        reserved slot back, its shadow placements ended."""
        if self.live.pop(f.rid, None) is None:
            return
        self.dispatch.release(f.ctx)
        self.shared.release(f.ctx)
        self.dispatch.finish(f.rid)

    def outcome(self, outcome: str) -> None:
        """A request's terminal outcome (``eldr_proxy_requests_total{endpoint="generate"}``)."""
        self.metrics.child(self.metrics.requests, "generate", outcome).inc()

    def stats(self) -> dict[str, Any]:
        """Counters and the current instances' loads (the component's ``stats`` endpoint answers this)."""
        rv = self.shared.reserver
        return {"policy": self.policy, "instances": [str(i) for i in self.instances], "loads": self.loads,
                "local_loads": [w.inflight for w in self.slots], "in_flight": len(self.live),
                "replicas": self.shared.live_replicas, "counts": dict(self.counts),
                "reservations": dict(rv.results) if rv is not None else None,
                "dispatched": {str(k): v for k, v in self.dispatched.items()},
                "shadow": self.shadow.describe() if self.shadow is not None else None}

    # -- the shared state's host (eldr_cli.proxy.replicas.shared.StateHost) ---------------------------
    def all_workers(self) -> list[Worker]:
        return list(self.slots)

    def local_vectors(self) -> dict[str, dict[str, list[int]]]:
        """A stateful policy's per-instance live state, published with the counts (eldr-live)."""
        if not self.instances:
            return {}
        vecs = {}
        for i, w in enumerate(self.slots):
            v = self.router.export_state(i)
            if v is None:
                return {}
            vecs[w.id] = v
        return {"live": vecs}

    def remote_vectors_changed(self) -> None:
        if self.instances:
            for i, w in enumerate(self.slots):
                self.router.merge_state(i, w.remote_vectors.get("live"))

    def apply_remote_change(self, action: str, body: dict[str, Any]) -> None:
        return None  # no admin API here: each replica is configured by its own command line

    def current_config(self) -> dict[str, Any]:
        return {"policy": self.policy, "decode": [w.url for w in self.slots]}

    def adopt_config(self, config: dict[str, Any]) -> None:
        return None
