"""Shadow mode (``eldr serve-proxy --policy jsq --shadow eldr-live``): at every decode decision each shadow
policy decides too, in the same decision path, on the live state it would have had if it had routed this
traffic, and only the live policy's choice is taken.

Each shadow is a :class:`eldr_cli.routing.DecodeRouter` from the one factory (``make_router``) with its own
counterfactual in-flight counts and live set: its choice is dispatched to itself (``on_dispatch``) and
finished when the real request finishes, as if its choices had been taken. With a routing artifact that
carries eldr-live's decode-activation model, each assignment (the live one and each shadow's) is also
followed by an eldr-live live set used only as a predictor of every decoder's next decode step
(``T_d = const + kt B_d + m0 + kb A_d + kv C_d``, the cost model's step form), read at scrape time, so
the operator sees the predicted step time (TPOT) of the shadow's assignment against the live one's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from eldr_cli.errors import EldrError
from eldr_cli.routing import Decision, DecodeRouter
from eldr_cli.routing.live import LiveDetail, live_set
from eldr_cli.routing.live_set import LiveSet

if TYPE_CHECKING:
    from eldr_cli.proxy.base import RouterState

log = logging.getLogger("eldr.proxy")


def _predictor(state: RouterState, n: int) -> LiveSet | None:
    """An eldr-live live set used only to predict step times (None without a decode-activation model)."""
    if state.model is None or state.model.live is None:
        return None
    return live_set(n, state.model, state.cost)


class Shadow:
    """One shadow policy: its router, counterfactual in-flight counts, and its assignment's predictor."""

    def __init__(self, name: str, router: DecodeRouter, predictor: LiveSet | None):
        self.name = name
        self.router = router
        self.loads = [0] * router.n_workers
        self.predictor = predictor
        self.where: dict[str, tuple[int, Decision]] = {}
        self.decisions = 0
        self.agree = 0


class ShadowSet:
    """Every shadow policy of one proxy (built at start; an admin change of the routing artifact rebuilds it)."""

    def __init__(self, state: RouterState, names: list[str]):
        self.state = state
        self.names = list(dict.fromkeys(names))
        self.refused: dict[str, str] = {}
        self.shadows: list[Shadow] = []
        self.live_predictor: LiveSet | None = None
        self._built_for: Any = None
        self.seconds: Any = None  # the shadows' decision-time histogram, once registered
        self._build()

    def _build(self) -> None:
        st = self.state
        n = len(st.decode)
        self.shadows, self.refused = [], {}
        for name in self.names:
            try:
                router = st.make(name, n, st.model, st.tau_override)
            except EldrError as e:
                self.refused[name] = str(e).splitlines()[0]
                log.warning("shadow policy %s refused: %s; the proxy serves without it", name, self.refused[name])
                continue
            pred = router.live_set if router.live_set is not None else _predictor(st, n)
            self.shadows.append(Shadow(name, router, pred))
        live = st.router
        self.live_predictor = _predictor(st, n) if self.shadows else None
        self._live_is_predictor = False
        if live.live_set is not None and self.live_predictor is not None:
            self.live_predictor, self._live_is_predictor = live.live_set, True
        self._built_for = (st.model, n, live)

    def follow(self) -> None:
        """Fresh shadows when the routing artifact, the decode pool's size or the live router changed (an admin
        change; in Dynamo, an instance that joined or left)."""
        st = self.state
        if len(st.decode) and self._built_for != (st.model, len(st.decode), st.router):
            self._build()

    def describe(self) -> dict[str, Any]:
        """What ``/health`` says: the shadows that decide, those refused and why, agreement so far."""
        return {"policies": [sh.name for sh in self.shadows], "refused": dict(self.refused),
                "agreement": {sh.name: (sh.agree / sh.decisions if sh.decisions else None) for sh in self.shadows}}

    def later(self, rid: str, counts: Any, live: Decision, domain: str | None, healthy: list[bool],
              tokens: int | None, row: dict[str, Any] | None, dlog: Any) -> None:
        """Schedule :meth:`decide` on the event loop right after the live decision's request is dispatched (same
        inputs, same order as the decisions: the request path pays the scheduling, not the shadows), then write
        the decision-log ``row`` with the shadows' choices beside the live one."""
        asyncio.get_running_loop().call_soon(self._decide_and_log, rid, counts, live, domain, healthy, tokens, row,
                                             dlog)

    def finish_later(self, rid: str) -> None:
        """:meth:`finish`, scheduled after every decision already scheduled (so never before its own)."""
        if self.shadows:
            asyncio.get_running_loop().call_soon(self.finish, rid)

    def _decide_and_log(self, rid: str, counts: Any, live: Decision, domain: str | None, healthy: list[bool],
                        tokens: int | None, row: dict[str, Any] | None, dlog: Any) -> None:
        try:
            shadow = self.decide(rid, counts, live, domain, healthy, tokens)
            if shadow and row is not None:  # the predicted steps of both assignments, as this request joined them
                self.add_steps(shadow, row.get("loads"), live.worker)
        except Exception:  # noqa: BLE001 - a shadow must never hurt serving
            log.exception("shadow decision failed")
            shadow = None
        if row is not None and dlog is not None:
            dlog.write(row | ({"shadow": shadow} if shadow else {}))

    def decide(self, rid: str, counts: Any, live: Decision, domain: str | None, healthy: list[bool],
               tokens: int | None) -> dict[str, Any] | None:
        """Every shadow's choice for request ``rid`` (the live one: ``live``), taken in its own state; returns
        what the decision log records beside the live choice."""
        t0 = time.perf_counter()
        try:
            return self._decide(rid, counts, live, domain, healthy, tokens)
        finally:
            if self.seconds is not None:
                self.seconds.observe(time.perf_counter() - t0)

    def _decide(self, rid: str, counts: Any, live: Decision, domain: str | None, healthy: list[bool],
                tokens: int | None) -> dict[str, Any] | None:
        self.follow()
        if not self.shadows:
            return None
        out: dict[str, Any] = {}
        known = live.detail  # an eldr-live choice (live or shadow) already names the request's prototype
        for sh in self.shadows:
            d = sh.router.decide(counts, sh.loads, domain=domain, healthy=healthy, tokens=tokens)
            sh.router.on_dispatch(d, rid)
            sh.loads[d.worker] += 1
            if isinstance(d.detail, LiveDetail):
                known = d.detail
            if sh.predictor is not None and sh.predictor is not sh.router.live_set:
                known = self._detail(counts, d, tokens, known)
                sh.predictor.add(d.worker, rid, known.entry, known.tokens)
            sh.where[rid] = (d.worker, d)
            sh.decisions += 1
            sh.agree += d.worker == live.worker
            out[sh.name] = {"chosen": d.worker, "agree": d.worker == live.worker,
                            "predicted_ms": None if d.predicted_ms is None else
                            [round(float(x), 4) for x in d.predicted_ms]}
        lp = self.live_predictor
        if lp is not None and not self._live_is_predictor:
            det = self._detail(counts, live, tokens, known)
            lp.add(live.worker, rid, det.entry, det.tokens)
        return out

    def _detail(self, counts: Any, d: Decision, tokens: int | None, known: Any) -> LiveDetail:
        """A predictor's record of a request (its live entry, tokens): the decision's own when it is eldr-live's,
        else one already found for this request, else predicted from the counts once."""
        if isinstance(d.detail, LiveDetail):
            return d.detail
        if isinstance(known, LiveDetail):
            return known
        pred = self.live_predictor or next(sh.predictor for sh in self.shadows if sh.predictor is not None)
        entry = None
        try:
            entry = pred.source.entry(counts)
        except EldrError:
            pass
        return LiveDetail(entry or pred.source.mean(), int(tokens or 0))

    def finish(self, rid: str) -> None:
        """Request ``rid`` ended (whatever its outcome): its shadow placements end with it."""
        if not self.shadows:
            return
        lp = self.live_predictor
        if lp is not None and not self._live_is_predictor:
            lp.remove(rid)
        for sh in self.shadows:
            rec = sh.where.pop(rid, None)
            if rec is None:
                continue
            w, _ = rec
            sh.loads[w] -= 1
            sh.router.on_finish(w, rid)
            if sh.predictor is not None and sh.predictor is not sh.router.live_set:
                sh.predictor.remove(rid)

    def add_steps(self, out: dict[str, Any], live_loads: list[int] | None, live_worker: int) -> None:
        """Each decoder's predicted next step under the live assignment (``live_step_ms``: the in-flight counts
        the live policy saw, plus this request) and under each shadow's (``step_ms``), into ``out``."""
        live_ms = None
        if live_loads is not None and self.live_predictor is not None:
            loads = [v + (k == live_worker) for k, v in enumerate(live_loads)]
            live_ms = _rounded(self.predicted_step_ms(self.live_predictor, loads))
        for sh in self.shadows:
            if sh.name in out and sh.predictor is not None:
                out[sh.name]["step_ms"] = _rounded(self.predicted_step_ms(sh.predictor, sh.loads))
                out[sh.name]["live_step_ms"] = live_ms

    def predicted_step_ms(self, pred: LiveSet | None, loads: list[int]) -> list[float] | None:
        """Each decoder's predicted next step (ms, or relative units without a cost model) for the live set
        ``pred`` follows and the in-flight counts ``loads``; 0 for an idle decoder."""
        if pred is None:
            return None
        out: list[float] = pred.step_ms(loads).tolist()
        return out


def _rounded(v: list[float] | None) -> list[float] | None:
    return None if v is None else [round(x, 4) for x in v]


class ShadowCollector:
    """``eldr_proxy_shadow_*``: decisions, agreements, counterfactual in flight and predicted step times."""

    def __init__(self, shadows: ShadowSet):
        self.s = shadows

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, st = self.s, self.s.state
        s.follow()  # the pool may have changed since the last decision
        ids = [w.id for w in st.decode.workers]
        dec = CounterMetricFamily("eldr_proxy_shadow_decisions", "Decisions a shadow policy took",
                                  labels=["shadow"])
        agr = CounterMetricFamily("eldr_proxy_shadow_agree", "Shadow decisions equal to the live one",
                                  labels=["shadow"])
        inf = GaugeMetricFamily("eldr_proxy_shadow_inflight", "Requests in flight per decoder had the shadow routed",
                                labels=["shadow", "worker"])
        step = GaugeMetricFamily("eldr_proxy_shadow_predicted_step_ms", "Predicted next decode step per decoder of "
                                 "the live and of the shadow's assignment (eldr-live's model and the cost model)",
                                 labels=["shadow", "assignment", "worker"])
        live_loads = [w.inflight for w in st.decode.workers]
        live_ms = s.predicted_step_ms(s.live_predictor, live_loads)
        for sh in s.shadows:
            dec.add_metric([sh.name], sh.decisions)
            agr.add_metric([sh.name], sh.agree)
            for wid, n in zip(ids, sh.loads, strict=True):
                inf.add_metric([sh.name, wid], n)
            ms = s.predicted_step_ms(sh.predictor, sh.loads)
            for label, vals in (("live", live_ms), ("shadow", ms)):
                for wid, v in zip(ids, vals or [], strict=False):
                    step.add_metric([sh.name, label, wid], v)
        yield from (dec, agr, inf, step)


def register_shadow_metrics(registry: Any, shadows: ShadowSet) -> None:
    """The shadow gauges and counters, and ``eldr_proxy_shadow_decision_seconds`` (all shadows of one request)."""
    from prometheus_client import Histogram

    registry.register(ShadowCollector(shadows))
    shadows.seconds = Histogram("eldr_proxy_shadow_decision_seconds", "Time the shadow policies add to one decode "
                                "decision (all shadows, their live sets and predictors)", registry=registry,
                                buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3))
