"""Prometheus metrics of one proxy instance (own registry: no global state outside the app)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from eldr_cli.proxy.replicas.auth import REASONS

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from eldr_cli.proxy.base import RouterState

OUTCOMES = ("ok", "bad_request", "too_large", "upstream_error", "stream_error", "cancelled", "unavailable")


class _LiveCollector:
    """Gauges read from the live proxy state at scrape time (in-flight, health, in-progress)."""

    def __init__(self, state: RouterState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        st = self.state
        inflight = GaugeMetricFamily("eldr_proxy_inflight", "Requests in flight per upstream worker",
                                     labels=["role", "worker", "url"])
        up = GaugeMetricFamily("eldr_proxy_worker_up", "1 if the worker passes health checks",
                               labels=["role", "worker", "url"])
        running = GaugeMetricFamily("eldr_proxy_worker_scraped_running",
                                    "vllm:num_requests_running last scraped from the worker",
                                    labels=["role", "worker", "url"])
        for pool in (st.prefill, st.decode):
            for w in pool:
                inflight.add_metric([w.role, w.id, w.url], w.inflight)
                up.add_metric([w.role, w.id, w.url], 1.0 if w.healthy else 0.0)
                if w.scraped_running is not None:
                    running.add_metric([w.role, w.id, w.url], w.scraped_running)
        yield inflight
        yield up
        yield running
        g = GaugeMetricFamily("eldr_proxy_requests_in_progress", "Client requests without a terminal outcome yet")
        g.add_metric([], st.in_progress)
        yield g
        p = GaugeMetricFamily("eldr_proxy_policy_info", "Current decode policy and tau", labels=["policy", "tau"])
        p.add_metric([st.policy_name, f"{st.tau_effective():g}"], 1.0)
        yield p
        yield from self._shared(st)

    def _shared(self, st: RouterState) -> Iterator[Metric]:
        """Cluster-wide view and the health of the shared state (replicas over Redis)."""
        sh = st.shared
        cluster = GaugeMetricFamily("eldr_proxy_cluster_inflight",
                                    "Requests in flight per upstream worker over all proxy replicas",
                                    labels=["role", "worker", "url"])
        for pool in (st.prefill, st.decode):
            for w in pool:
                cluster.add_metric([w.role, w.id, w.url], w.inflight + w.remote_inflight)
        yield cluster
        g = GaugeMetricFamily("eldr_proxy_state_replicas", "Live proxy replicas seen through the shared state",
                              labels=["state"])
        g.add_metric([sh.kind], sh.live_replicas)
        yield g
        g = GaugeMetricFamily("eldr_proxy_state_sync_age_seconds",
                              "Seconds since the other replicas' counts were last read (state-sync lag)")
        g.add_metric([], sh.sync_age_s())
        yield g
        c = CounterMetricFamily("eldr_proxy_state_errors", "Failed shared-state (Redis) operations")
        c.add_metric([], sh.errors)
        yield c
        c = CounterMetricFamily("eldr_proxy_state_outages", "Times the shared state became unreachable")
        c.add_metric([], sh.outages)
        yield c
        c = CounterMetricFamily("eldr_proxy_state_rejected", "Shared-state messages and values ignored, by "
                                f"reason ({', '.join(REASONS)})", labels=["reason"])
        for reason, n in sh.rejected.items():
            c.add_metric([reason], n)
        yield c
        if sh.reserver is not None:
            c = CounterMetricFamily("eldr_proxy_state_reservations", "Atomic decode-slot reservations in Redis "
                                    "(timeout/error/skipped/departed: decided locally)", labels=["result"])
            for result, n in sh.reserver.results.items():
                c.add_metric([result], n)
            yield c


class ProxyMetrics:
    def __init__(self, state: RouterState):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("eldr_proxy_requests", "Client requests by endpoint and terminal outcome",
                                ["endpoint", "outcome"], registry=r)
        self.decisions = Counter("eldr_proxy_decisions", "Decode routing decisions by policy and the worker used "
                                 "(after the replicas' reservation)", ["policy", "worker"], registry=r)
        self.moved = Counter("eldr_proxy_decisions_moved", "Decisions whose worker differs from the policy's first "
                             "choice (that one down, or moved by the replicas' reservation)", ["policy"], registry=r)
        self.prefill_dispatch = Counter("eldr_proxy_prefill_dispatch", "Prefill legs sent per worker",
                                        ["worker"], registry=r)
        self.decision_seconds = Histogram(
            "eldr_proxy_decision_seconds", "Decode routing decision time (signature decode + transform + policy)",
            ["policy"], registry=r,
            buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 1e-2))
        self.band_size = Histogram("eldr_proxy_band_size", "Locality band size |{k: s_k >= s* - tau}|",
                                   registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.signature_missing = Counter(
            "eldr_proxy_signature_missing", "Prefill answers without a usable signature (routed by JSQ)",
            ["reason"], registry=r)
        self.upstream_errors = Counter("eldr_proxy_upstream_errors", "Upstream failures by role, worker and kind",
                                       ["role", "worker", "kind"], registry=r)
        self.retries = Counter("eldr_proxy_retries", "Retries of a leg on another worker", ["role"], registry=r)
        self.health_transitions = Counter("eldr_proxy_health_transitions", "Workers marked down or up",
                                          ["role", "worker", "to"], registry=r)
        self.admin_actions = Counter("eldr_proxy_admin_actions", "Admin requests", ["action", "result"], registry=r)
        r.register(_LiveCollector(state))
        # pre-create label sets people alert on, so they read 0 instead of being absent
        for reason in ("missing", "malformed"):
            self.signature_missing.labels(reason)
        self.retries.labels("prefill")

        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def watch_decision_log(self, dlog: Any) -> None:
        """Export the decision log's written and dropped rows (read at scrape time)."""
        from eldr_cli.proxy.decisionlog import DecisionLogCollector

        self.registry.register(DecisionLogCollector(dlog))

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)`` cached (labels() costs a lock and a dict build per call)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
