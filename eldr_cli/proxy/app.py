"""The proxy as a plain ASGI application (served by uvicorn with httptools + uvloop): the app object
keeps lifecycle and ASGI routing; each concern has its module: the PD exchange's HTTP legs (``exchange``), the
hand-off to a decode worker (``dispatch``: decide, hold, reserve, record, shadows), admin
(``admin``), health (``health``), HTTP plumbing and errors (``http``), shared state between replicas (``replicas``).

PD flow per request (vLLM's disaggregated-serving protocol, as its NIXL proxy speaks it):

1. prefill leg -> a prefill worker chosen by PrefixHash (least-loaded above 1.25x the average):
   the client's body with ``stream=false``, ``max_tokens=1`` (and ``max_completion_tokens=1`` if
   present), ``min_tokens``/``stream_options`` removed and ``kv_transfer_params`` asking for remote
   decode. Error or timeout: one retry on another prefill worker, then 502 with the reason.
2. handoff: pop ``eldr_signature`` from the returned ``kv_transfer_params`` (eldr_cli.handoff),
   decode its counts and let the proxy's one decode router (``eldr_cli.routing.DecodeRouter``) choose the
   decode worker from the live in-flight loads. A missing or malformed signature is routed by JSQ (the
   eldr policy's own fallback) and counted, never an error.
3. decode leg -> the chosen decode worker: the client's original body with the returned
   ``kv_transfer_params`` (without ``eldr_signature``; ``null`` passes as ``null``); the answer is
   relayed as is (SSE chunk by chunk when streaming), so usage counts the prompt once.

Every client request ends in exactly one terminal outcome (metrics.OUTCOMES); in-flight counters
are decremented in ``finally`` blocks, and a client disconnect cancels the upstream leg, which
closes the upstream connection (vLLM then aborts the request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from eldr_cli.proxy.admin import AdminMixin
from eldr_cli.proxy.base import ProxyState
from eldr_cli.proxy.config import ProxyConfig
from eldr_cli.proxy.dispatch import Dispatcher, Recorder
from eldr_cli.proxy.exchange import Exchange
from eldr_cli.proxy.health import HealthMixin
from eldr_cli.proxy.http import ENDPOINTS, Receive, Scope, Send, error_body, send_bytes, send_json
from eldr_cli.proxy.metrics import ProxyMetrics
from eldr_cli.proxy.upstream import HttpPool
from eldr_cli.proxy.workers import Worker

log = logging.getLogger("eldr.proxy")


class ProxyApp(AdminMixin, HealthMixin):
    """ASGI app. ``await app.start()`` / ``await app.stop()`` are run by the ASGI lifespan (or
    lazily on the first request when the server does not send lifespan events)."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.state = ProxyState(cfg)
        self.metrics = ProxyMetrics(self.state)
        self.decision_log = None
        self.drift = None
        self.shadow = None
        if cfg.shadow:  # a shadow the routing artifact cannot build is refused here, once; the proxy serves
            from eldr_cli.proxy.shadow import ShadowSet, register_shadow_metrics

            self.shadow = ShadowSet(self.state, cfg.shadow)
            register_shadow_metrics(self.metrics.registry, self.shadow)
        st = self.state
        if st.model is not None:  # every policy an admin may swap to that reads signatures: loops compiled now
            from eldr_cli.handoff import WIRE_DTYPES  # (seconds, the first time on a machine), not in a swap
            from eldr_cli.routing.compiled import warm

            warm(WIRE_DTYPES, read_only=True)
        self.exchange = Exchange(cfg, self.metrics, st.prefill, st.prefix, st.shared, st, self._dispatcher())
        self._started = False
        self._health_task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
    # -- lifetime -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for w in [*self.state.prefill, *self.state.decode]:
            self._open(w)
        if self.cfg.decision_log:
            from eldr_cli.proxy.decisionlog import DecisionLog

            self.decision_log = DecisionLog(self.cfg.decision_log, replay=self.cfg.decision_log_replay)
            self.metrics.watch_decision_log(self.decision_log)
        if self.drift is not None:
            self.drift.start()
        elif self.state.model is not None:
            from eldr_cli.proxy.drift import DriftCollector, DriftWatch

            self.drift = DriftWatch(self.state)
            self.metrics.registry.register(DriftCollector(self.drift))
        self._build_dispatch()  # with the decision log and the drift watch
        if self.cfg.health_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        await self.state.shared.start(self)
        log.info("proxy started", extra={"event": "start", "policy": self.state.policy_name,
                                         "prefill": [w.url for w in self.state.prefill],
                                         "decode": [w.url for w in self.state.decode]})

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.state.shared.stop()
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        for t in list(self._bg):
            t.cancel()
        for w in [*self.state.prefill, *self.state.decode]:
            if w.session is not None:
                await w.session.close()
                w.session = None
        if self.decision_log is not None:
            self.decision_log.close()
            self.decision_log = None
            self._build_dispatch()
        if self.drift is not None:
            self.drift.close()
    @property
    def dispatch(self) -> Dispatcher:
        """The hand-off the next request gets."""
        return self.exchange.dispatch

    def _dispatcher(self) -> Dispatcher:
        st, cfg = self.state, self.cfg
        recorder = Recorder(self.metrics, self.decision_log, self.drift, st.routing_path, cfg.scrape_metrics)
        return Dispatcher(st.router, st.decode, st.shared, recorder, self.shadow, tau=st.tau_effective(),
                          scrape_metrics=cfg.scrape_metrics)

    def _build_dispatch(self) -> None:
        """The hand-off (:class:`Dispatcher`) again from the parts as they are now: at start (the decision log and
        the drift watch) and after every admin swap (a request keeps the dispatcher it started with)."""
        self.exchange.dispatch = self._dispatcher()

    # -- shared state (several replicas) -------------------------------------------------------
    def all_workers(self) -> list[Worker]:
        return [*self.state.prefill, *self.state.decode]

    def local_vectors(self) -> dict[str, dict[str, list[int]]]:
        """A stateful policy's per-decoder live state, read when the counts are published (eldr-live)."""
        router, vecs = self.state.router, {}
        for i, w in enumerate(self.state.decode.workers):
            v = router.export_state(i)
            if v is None:  # the policy shares nothing
                return {}
            vecs[w.id] = v
        return {"live": vecs}

    def remote_vectors_changed(self) -> None:
        """The other replicas' summed vectors arrived (``Worker.remote_vectors``): into the policy."""
        router = self.state.router
        for i, w in enumerate(self.state.decode.workers):
            router.merge_state(i, w.remote_vectors.get("live"))

    def _open(self, w: Worker) -> None:
        # one keep-alive pool per upstream worker
        w.session = HttpPool(w.url, connect_timeout=self.cfg.connect_timeout_s,
                             max_idle=self.cfg.max_connections_per_worker)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _close_when_drained(self, w: Worker) -> None:
        while w.inflight > 0:
            await asyncio.sleep(0.2)
        if w.session is not None:
            await w.session.close()
            w.session = None

    # -- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        typ = scope["type"]
        if typ == "http":
            if not self._started:
                await self.start()
            path, method = scope["path"], scope["method"]
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None and method == "POST":
                return await self.exchange.generate(endpoint, scope, receive, send)
            if method == "GET":
                if path == "/health":
                    return await self._health(send)
                if path == "/metrics":
                    return await send_bytes(send, 200, self.metrics.render(),
                                       [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
                if path == "/v1/models":
                    return await self._models(send)
                if path == "/admin/workers":
                    return await self._admin(path, method, scope, receive, send)
            if path.startswith("/admin/") and method == "POST":
                return await self._admin(path, method, scope, receive, send)
            if endpoint is not None or path in ("/health", "/metrics", "/v1/models"):
                return await send_json(send, 405, error_body(f"method {method} not allowed on {path}",
                                                        "invalid_request_error", 405))
            return await send_json(send, 404, error_body(f"no route {path}", "not_found_error", 404))
        if typ == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.start()
                    except Exception as e:  # surface as a failed startup, not a hang
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return


def create_app(config: ProxyConfig | None = None, **kwargs: Any) -> ProxyApp:
    """The app factory: ``create_app(ProxyConfig(...))`` or ``create_app(prefill=[...], decode=[...], ...)``."""
    cfg = config if config is not None else ProxyConfig(**kwargs)
    return ProxyApp(cfg.validate())
