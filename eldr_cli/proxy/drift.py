"""The proxy's drift watch: every handed-off signature is scored against the routing artifact by one thread
off the request path (:class:`eldr_cli.routing.drift.DriftMonitor`), exported as Prometheus gauges and in
``/health``. An admin reload of the routing artifact starts a fresh window for the new one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from eldr_cli.proxy.background import QueueThread
from eldr_cli.routing.drift import DriftMonitor

if TYPE_CHECKING:
    from eldr_cli.proxy.base import ProxyState

log = logging.getLogger("eldr.proxy")


def drift_stats(path: str | None) -> dict[str, Any] | None:
    """The ``drift`` block stored in a routing artifact at fit time (None: fitted before it)."""
    from eldr_cli.routing.model import load_routing_artifact

    return load_routing_artifact(path).params.get("drift") if path else None  # type: ignore[no-untyped-call]


class DriftWatch:
    """Signatures queued by the request path, scored by one thread against the current routing artifact."""

    def __init__(self, state: ProxyState, queue_rows: int = 4096):
        self.state = state
        self.dropped = 0
        self._monitor: DriftMonitor | None = None
        self._path: str | None = None
        self._lock = threading.Lock()
        self._worker = QueueThread("eldr-drift", self._score, queue_rows)
        self.start()

    def start(self) -> None:
        """Start the scoring thread (again after :meth:`close`)."""
        self._worker.start()

    def observe(self, enc: Any) -> None:
        """One handed-off signature: as it arrived (a dict) or decoded (int counts [L, E], which the watch only
        reads); never blocks: a full queue skips it, counted."""
        if isinstance(enc, (dict, np.ndarray)) and not self._worker.offer(enc):
            self.dropped += 1

    def _current(self) -> DriftMonitor | None:
        st = self.state
        if st.model is None:
            return None
        if self._monitor is None or self._path != st.routing_path:
            try:
                stats = drift_stats(st.routing_path)
            except Exception:  # noqa: BLE001 - a vanished artifact must not stop the watch
                stats = None
            with self._lock:
                self._monitor, self._path = DriftMonitor.for_model(st.model, stats), st.routing_path
        return self._monitor

    def _score(self, enc: Any) -> None:
        from eldr_cli.handoff import decode_counts

        mon = self._current()
        if mon is None:
            return
        try:
            counts = enc if isinstance(enc, np.ndarray) else decode_counts(enc)
            sig = self.state.model.signature(counts)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - a bad signature is counted as missing on the request path
            return
        with self._lock:
            mon.observe(sig)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued signature is scored (tests, shutdown)."""
        self._worker.drain(timeout_s)

    def snapshot(self) -> dict[str, Any] | None:
        with self._lock:
            mon = self._monitor
            return None if mon is None else mon.snapshot()

    def close(self) -> None:
        self._worker.close(10.0)


class DriftCollector:
    """``eldr_proxy_drift_*`` gauges read at scrape time."""

    def __init__(self, watch: DriftWatch):
        self.watch = watch

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.watch.snapshot() or {}
        sim = GaugeMetricFamily("eldr_proxy_drift_similarity", "Rolling mean cosine of the served signatures to "
                                "the nearest centroid / eldr-live prototype", labels=["to"])
        cal = GaugeMetricFamily("eldr_proxy_drift_calibration_similarity", "The calibration set's mean of the same "
                                "(stored in the routing artifact at fit time)", labels=["to"])
        thr = GaugeMetricFamily("eldr_proxy_drift_threshold", "Rolling mean below which the traffic has drifted",
                                labels=["to"])
        ref = snap.get("calibration") or {}
        for to in ("centroid", "prototype"):
            if snap.get(f"{to}_similarity") is not None:
                sim.add_metric([to], snap[f"{to}_similarity"])
            if ref.get(to):
                cal.add_metric([to], ref[to]["mean"])
                thr.add_metric([to], ref[to]["threshold"])
        yield from (sim, cal, thr)
        g = GaugeMetricFamily("eldr_proxy_drift_band_all_share", "Share of the window's requests whose locality "
                              "band covers every decoder (routed like JSQ)")
        if snap.get("band_all_share") is not None:
            g.add_metric([], snap["band_all_share"])
        yield g
        g = GaugeMetricFamily("eldr_proxy_drift_window_requests", "Requests in the rolling window")
        g.add_metric([], snap.get("requests", 0))
        yield g
        g = GaugeMetricFamily("eldr_proxy_drift_flag", "1 when the traffic has drifted beyond the calibration "
                              "threshold, 0 when not (absent until a full window)")
        if snap.get("drifted") is not None:
            g.add_metric([], 1.0 if snap["drifted"] else 0.0)
        yield g
        c = CounterMetricFamily("eldr_proxy_drift_skipped", "Signatures not scored (the drift queue was full)")
        c.add_metric([], self.watch.dropped)
        yield c

