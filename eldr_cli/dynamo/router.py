"""The decision of eldr's Dynamo decode router, without Dynamo: which decode *instance* a request goes to.

:class:`InstanceRouter` keeps the decode instances it discovers in slots (instance ids, sorted), one eldr
:class:`~eldr_cli.routing.DecodeRouter` over those slots (from :func:`~eldr_cli.routing.make_router`, the one
factory), and the in-flight requests it dispatched to each (their loads, and the live sets of a stateful policy
such as eldr-live: ``on_dispatch`` / ``on_finish`` around each stream). When the set of instances changes it
builds the router anew over the new slots and dispatches the requests still in flight on the instances that
stayed into it again, so a policy's live sets survive an instance that joins or leaves.

The signature is the one eldr's vLLM plugin writes: ``prefill_result.disaggregated_params.kv_transfer_params
["eldr_signature"]`` in the request Dynamo's frontend hands its decode tier. It is popped (the decode engine's
KV connector never sees it), decoded with :func:`eldr_cli.handoff.decode_counts` and given to the router.
A request without one (or with a malformed one) goes to the least-loaded instance and is counted.

Each decision goes to a :class:`Recorder`: the seam where the proxy's dispatch object (decision log, metrics,
shadow policies: ``eldr_cli/proxy/dispatch.py``, built in parallel) plugs in. Until then
:class:`DecisionLogRecorder` writes the proxy's decision-log rows (:func:`eldr_cli.proxy.decisionlog.decision_row`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.handoff import SignatureDecodeError, decode_counts, pop_signature
from eldr_cli.proxy.workers import Worker
from eldr_cli.routing import Decision, DecodeRouter, RoutingModel, make_router
from eldr_cli.routing.registry import check_policy


class NoDecodeInstance(EldrError):
    """No decode instance is registered at the decode endpoint (the request fails with this message)."""


def kv_transfer_params(request: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill's ``kv_transfer_params`` inside a Dynamo decode request (None when it has none)."""
    pr = request.get("prefill_result")
    dp = pr.get("disaggregated_params") if isinstance(pr, dict) else None
    kv = dp.get("kv_transfer_params") if isinstance(dp, dict) else None
    return kv if isinstance(kv, dict) else None


def context_tokens(request: dict[str, Any]) -> int | None:
    """The KV tokens the request holds on its decoder on average (prompt + half its output budget), as the
    proxy counts them (:func:`eldr_cli.proxy.request.context_tokens`); None without token ids."""
    ids = request.get("token_ids")
    if not isinstance(ids, list):
        return None
    stop = request.get("stop_conditions")
    out = stop.get("max_tokens") if isinstance(stop, dict) else None
    return len(ids) + (out // 2 if isinstance(out, int) and not isinstance(out, bool) and out > 0 else 0)


@dataclass
class Choice:
    """One request's decode instance while it streams (``slot`` follows the instance across rebuilds; None once
    the instance has left)."""

    rid: str
    instance_id: int
    slot: int | None
    decision: Decision
    signature: str
    loads: list[int]
    seconds: float
    policy: str
    tau: float | None
    first_instance: int | None = None
    counts: np.ndarray | None = None     # the decoded prefill counts (a second decision reuses them)
    tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Recorder(Protocol):
    """Where each decision goes once made (decision log, metrics, shadows)."""

    def decided(self, choice: Choice) -> None: ...


class InstanceRouter:
    """eldr's decode decision over the decode instances a Dynamo component discovers (see the module doc).

    Each instance is a :class:`eldr_cli.proxy.workers.Worker` (``id``: the instance id, ``url``:
    ``dynamo://<id>``): its ``inflight`` is this replica's, its ``remote_inflight`` the other replicas' when a
    shared state (``shared``: :mod:`eldr_cli.proxy.replicas`) publishes them; the router also serves as that
    state's host (``all_workers``, ``local_vectors``, ``remote_vectors_changed``)."""

    def __init__(self, policy: str, *, model: RoutingModel | None = None, cost: Any = None,
                 tau: float | None = None, seed: int = 0, recorder: Recorder | None = None):
        from eldr_cli.proxy.replicas.shared import LocalState

        self.policy = check_policy(policy, servable=True)
        self.model, self.cost, self.tau_override, self.seed = model, cost, tau, seed
        make_router(policy, 1, model=model, tau=tau, seed=seed, cost=cost)  # fails here if its artifact cannot serve it
        self.recorder = recorder
        self.shared: Any = LocalState()
        self.instances: list[int] = []
        self.slots: list[Worker] = []
        self.router: DecodeRouter | None = None
        self.live: dict[str, Choice] = {}
        self.counts: Counter[str] = Counter()   # requests, signature_<state>, rebuilds, orphaned, retries
        self.dispatched: Counter[int] = Counter()

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
        self.slots = [kept.get(i) or Worker(str(i), "decode", f"dynamo://{i}") for i in ids]
        self.router = make_router(self.policy, len(ids), model=self.model, tau=self.tau_override, seed=self.seed,
                                  cost=self.cost) if ids else None
        slot_of = {iid: i for i, iid in enumerate(ids)}
        self.counts["rebuilds"] += 1
        for rid, ch in self.live.items():
            ch.slot = slot_of.get(ch.instance_id)
            if ch.slot is None:
                self.counts["orphaned"] += 1  # its instance left mid-stream; its stream fails or ends there
                continue
            assert self.router is not None
            self.router.on_dispatch(replace(ch.decision, worker=ch.slot), rid)
        self.remote_vectors_changed()
        return True

    # -- one request ----------------------------------------------------------------------------------
    def choose(self, request: dict[str, Any], rid: str, *, record: bool = True) -> Choice:
        """Decide ``request``'s decode instance and hold it there until :meth:`finish` (nothing awaits between).
        ``record=False``: the caller records it with :meth:`record` once the replicas' reservation has spoken."""
        if self.router is None:
            raise NoDecodeInstance("no decode instance is registered at the decode endpoint")
        if rid in self.live:
            raise EldrError(f"request id {rid!r} is already in flight at this router")
        counts, state = self._counts(request, self.router)
        ch = self._decide(rid, counts, state, context_tokens(request))
        if record:
            self.record(ch)
        return ch

    def again(self, choice: Choice, exclude: set[int]) -> Choice:
        """``choice``'s instance failed before answering: finish it there and decide again among the instances
        not in ``exclude``, on the same signature (counted under ``retries``)."""
        self.finish(choice)
        self.sync([i for i in self.instances if i not in exclude])
        if self.router is None:
            raise NoDecodeInstance("no other decode instance is registered at the decode endpoint")
        self.counts["retries"] += 1
        ch = self._decide(choice.rid, choice.counts, choice.signature, choice.tokens)
        self.record(ch, again=True)
        return ch

    def move(self, choice: Choice, slot: int) -> None:
        """The replicas' reservation put ``choice`` on ``slot`` instead: out of its old instance, into the new."""
        if slot == choice.slot or choice.slot is None or self.router is None:
            return
        self.slots[choice.slot].inflight -= 1
        self.router.on_finish(choice.slot, choice.rid)
        choice.decision = replace(choice.decision, worker=slot)
        self.router.on_dispatch(choice.decision, choice.rid)
        choice.slot, choice.instance_id = slot, self.instances[slot]
        self.slots[slot].inflight += 1
        self.shared.note_change()

    def _decide(self, rid: str, counts: np.ndarray | None, state: str, tokens: int | None) -> Choice:
        router = self.router
        assert router is not None
        t0 = time.perf_counter()
        loads = self.loads
        if counts is None and router.needs_signature:
            d = Decision(int(np.argmin(loads)), state)  # least loaded; ties: the lowest instance id
        else:
            d = router.decide(counts, loads, tokens=tokens)
            if d.signature == "malformed":  # decoded, but not of the artifact's shape
                state = "malformed"
        router.on_dispatch(d, rid)
        self.slots[d.worker].inflight += 1
        self.shared.note_change()
        dt = time.perf_counter() - t0
        first = self.instances[d.first] if 0 <= d.first < len(self.instances) else None
        tau = router.tau if router.tau is not None else (self.model.tau if self.model is not None else None)
        ch = Choice(rid, self.instances[d.worker], d.worker, d, state, loads, dt, router.name, tau, first, counts,
                    tokens)
        self.live[rid] = ch
        return ch

    def record(self, ch: Choice, again: bool = False) -> None:
        """Count ``ch`` (where it went, its signature) and hand it to the recorder."""
        if not again:
            self.counts["requests"] += 1
            self.counts[f"signature_{ch.signature}"] += 1
        self.dispatched[ch.instance_id] += 1
        if self.recorder is not None:
            self.recorder.decided(ch)

    def finish(self, choice: Choice) -> None:
        """The request's stream ended (done, failed or cancelled): out of its instance's load and live set."""
        if self.live.pop(choice.rid, None) is None or choice.slot is None or self.router is None:
            return
        self.slots[choice.slot].inflight -= 1
        self.router.on_finish(choice.slot, choice.rid)
        self.shared.note_change()

    def _counts(self, request: dict[str, Any], router: DecodeRouter) -> tuple[np.ndarray | None, str]:
        enc = pop_signature(kv_transfer_params(request))
        if enc is None:
            return None, "missing"
        if not router.needs_signature:
            return None, "unused"
        try:
            return decode_counts(enc), "ok"
        except SignatureDecodeError:
            return None, "malformed"

    def stats(self) -> dict[str, Any]:
        """Counters and the current instances' loads (the component's ``stats`` endpoint answers this)."""
        return {"policy": self.policy, "instances": [str(i) for i in self.instances], "loads": self.loads,
                "local_loads": [w.inflight for w in self.slots], "in_flight": len(self.live),
                "replicas": self.shared.live_replicas, "counts": dict(self.counts),
                "reservations": dict(self.shared.reserver.results) if self.shared.reserver is not None else None,
                "dispatched": {str(k): v for k, v in self.dispatched.items()}}

    # -- the shared state's host (eldr_cli.proxy.replicas.shared.StateHost) ---------------------------
    def all_workers(self) -> list[Worker]:
        return list(self.slots)

    def local_vectors(self) -> dict[str, dict[str, list[int]]]:
        """A stateful policy's per-instance live state, published with the counts (eldr-live)."""
        if self.router is None:
            return {}
        vecs = {}
        for i, w in enumerate(self.slots):
            v = self.router.export_state(i)
            if v is None:
                return {}
            vecs[w.id] = v
        return {"live": vecs}

    def remote_vectors_changed(self) -> None:
        if self.router is not None:
            for i, w in enumerate(self.slots):
                self.router.merge_state(i, w.remote_vectors.get("live"))

    def apply_remote_change(self, action: str, body: dict[str, Any]) -> None:
        return None  # no admin API here: each replica is configured by its own command line

    def current_config(self) -> dict[str, Any]:
        return {"policy": self.policy, "decode": [w.url for w in self.slots]}

    def adopt_config(self, config: dict[str, Any]) -> None:
        return None


class DecisionLogRecorder:
    """The proxy's decision-log rows for each decision (``worker``: the Dynamo instance id, as a string)."""

    def __init__(self, path: str):
        from eldr_cli.proxy.decisionlog import DecisionLog

        self.log = DecisionLog(path)

    def decided(self, choice: Choice) -> None:
        import time

        from eldr_cli.proxy.dispatch import DecisionRecord

        first = str(choice.instance_id if choice.first_instance is None else choice.first_instance)
        tau = float("nan") if choice.tau is None else choice.tau
        rec = DecisionRecord(choice.rid, choice.policy, choice.decision, str(choice.instance_id), first,
                             choice.signature, tuple(choice.loads), tau, None, choice.seconds, time.time())
        self.log.write(rec.row() | choice.extra)

    def flush(self) -> None:
        self.log.flush()

    def close(self) -> None:
        self.log.close()
