"""``/health``, ``/v1/models`` and the active health checks (with optional load scraping)."""

from __future__ import annotations

import asyncio
import logging

from eldr_cli.proxy.http import JSON_HEADER, Send, error_body, http_get, send_bytes, send_json
from eldr_cli.proxy.parts import AppParts
from eldr_cli.proxy.tpot import update_tpot
from eldr_cli.proxy.upstream import UpstreamError
from eldr_cli.proxy.workers import Worker

log = logging.getLogger("eldr.proxy")


class HealthMixin(AppParts):
    """Health endpoints and checks of :class:`eldr_cli.proxy.app.ProxyApp`."""

    # -- other endpoints ------------------------------------------------------------------------
    async def _health(self, send: Send) -> None:
        st = self.state
        p_up, d_up = len(st.prefill.healthy()), len(st.decode.healthy())
        ok = p_up > 0 and d_up > 0
        body = {"status": "ok" if ok else "unavailable", "policy": st.policy_name, "tau": st.tau_effective(),
                "routing": st.routing_path, "prefill_up": p_up, "decode_up": d_up,
                "in_progress": st.in_progress, "state": st.shared.kind, "replica": st.shared.replica_id,
                "replicas": st.shared.live_replicas, "state_outage": st.shared.outage_kind,
                "state_rejected": st.shared.rejected,
                "state_wrong_key": st.shared.wrong_key(),
                "workers": [w.as_dict() for w in [*st.prefill, *st.decode]],
                "drift": None if self.drift is None else self.drift.snapshot(),
                "shadow": None if self.shadow is None else self.shadow.describe()}
        await send_json(send, 200 if ok else 503, body)

    async def _models(self, send: Send) -> None:
        st = self.state
        errs = []
        for w in [*st.decode.healthy(), *st.prefill.healthy()]:
            try:
                status, data = await http_get(w, "/v1/models", 10.0)
                if status == 200:
                    return await send_bytes(send, 200, data, [JSON_HEADER])
                errs.append(f"{w.id}: HTTP {status}")
            except (UpstreamError, TimeoutError) as e:
                errs.append(f"{w.id}: {e or type(e).__name__}")
        await send_json(send, 502, error_body("no worker answered /v1/models: " + "; ".join(errs),
                                              "upstream_error", 502))

    # -- health checks and load scraping --------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the checker die
                log.exception("health check round failed")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def check_health_once(self) -> None:
        ws = [w for w in [*self.state.prefill, *self.state.decode] if w.session is not None]
        await asyncio.gather(*(self._check(w) for w in ws))

    async def _check(self, w: Worker) -> None:
        cfg = self.cfg
        ok = False
        try:
            status, _ = await http_get(w, cfg.health_path, cfg.health_timeout_s)
            ok = status == 200
            if ok and cfg.scrape_metrics and w.role == "decode":
                status, data = await http_get(w, "/metrics", cfg.health_timeout_s)
                text = data.decode("utf-8", "replace") if status == 200 else ""
                w.scraped_running = parse_running(text) if status == 200 else None
                update_tpot(w, text)
        except (UpstreamError, TimeoutError, ValueError):
            pass  # a failed scrape after a good /health still counts the worker as up
        if ok:
            w.fail_streak, w.ok_streak = 0, w.ok_streak + 1
            if not w.healthy and w.ok_streak >= cfg.health_success_threshold:
                w.healthy = True
                self.state.shared.publish_change("health", {"role": w.role, "url": w.url, "healthy": True})
                self.metrics.child(self.metrics.health_transitions, w.role, w.id, "up").inc()
                log.warning("worker up", extra={"event": "health", "worker": w.id, "url": w.url, "to": "up"})
        else:
            w.ok_streak, w.fail_streak = 0, w.fail_streak + 1
            w.scraped_running = None
            if w.healthy and w.fail_streak >= cfg.health_fail_threshold:
                w.healthy = False
                self.state.shared.publish_change("health", {"role": w.role, "url": w.url, "healthy": False})
                self.metrics.child(self.metrics.health_transitions, w.role, w.id, "down").inc()
                log.warning("worker down", extra={"event": "health", "worker": w.id, "url": w.url, "to": "down"})


def parse_running(text: str) -> int | None:
    """Sum of ``vllm:num_requests_running`` samples in a Prometheus text page (None if absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return int(total) if seen else None
