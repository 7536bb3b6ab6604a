"""The proxy's drift watch: every handed-off signature is scored against the routing artifact by one thread
off the request path (:class:`eldr_cli.routing.drift.DriftMonitor`), exported as Prometheus gauges and in
``/health``. An admin reload of the routing artifact starts a fresh window for the new one."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from eldr_cli.routing.drift import DriftMonitor

if TYPE_CHECKING:
    from eldr_cli.proxy.base import ProxyState

log = logging.getLogger("eldr.proxy")


def drift_stats(path: str | None) -> dict[str, Any] | None:
    """The ``drift`` block stored in a routing artifact at fit time (None: fitted before it)."""
    from eldr_cli.routing.model import load_routing_artifact

    return load_routing_artifact(path).params.get("drift") if path else None  # type: ignore[no-untyped-call]


DRIFT_CPU_SHARE = 0.02  # the drift watch's CPU bound: at most this share of one core, averaged over its passes
DRIFT_PERIOD_S = 0.25   # signatures queued meanwhile are scored together, one pass per period at most
# (a pass has a fixed cost, a thread wake-up and the GIL: at 200 req/s, 0.05 s cost 40 us per signature, 0.25 s 25)


class DriftWatch:
    """Signatures queued by the request path, scored by one thread against the current routing artifact.

    The request path appends to a bounded queue and wakes nothing; the thread scores what was queued in one
    vectorized pass every :data:`DRIFT_PERIOD_S` and measures its own CPU time (``cpu_s``, ``scored``). After a
    pass of c CPU seconds it waits at least c / :data:`DRIFT_CPU_SHARE` before the next, so that it never takes
    more than that share of a core: when the traffic needs more, the queue fills and the signatures it cannot
    take are skipped, counted (``dropped``), and the window holds a sample of the traffic. Loading a new
    artifact's calibration figures (once per artifact) counts in ``cpu_s`` but not in the pacing: one slow
    set-up must not make the watch wait as if every pass cost that much."""

    def __init__(self, state: ProxyState, queue_rows: int = 4096):
        self.state = state
        self.queue_rows = queue_rows
        self.dropped = self.scored = 0
        self.cpu_s = 0.0
        self._monitor: DriftMonitor | None = None
        self._path: str | None = None
        self._lock = threading.Lock()
        self._pending: deque[Any] = deque()
        self._offered = self._handled = 0
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._stop = False
        self._thread = threading.Thread()
        self.start()

    def start(self) -> None:
        """Start the scoring thread (again after :meth:`close`)."""
        if not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="eldr-drift", daemon=True)
            self._thread.start()

    def observe(self, enc: Any) -> None:
        """One handed-off signature: as it arrived (a dict), decoded (int counts [L, E]) or as the decision's Eq. 2
        cells ((routing model, float64 [N* x E], the prototype eldr-live found nearest): scored only while that
        model is the current one), which the watch only reads; never blocks: a full queue skips it, counted."""
        if not isinstance(enc, (dict, np.ndarray, tuple)):
            return
        if len(self._pending) >= self.queue_rows:
            self.dropped += 1
            return
        self._pending.append(enc)
        self._offered += 1

    def _run(self) -> None:
        from eldr_cli.routing.compiled import warm_drift

        warm_drift()  # its compiled loop ready before the first pass (here: off the request path and the start-up's)
        wait = DRIFT_PERIOD_S
        while not self._stop:
            self._wake.wait(wait)
            self._wake.clear()
            t_setup = time.thread_time()
            n = len(self._pending)
            if n:
                self._current()  # an artifact's figures, loaded once per artifact: counted, not paced as if recurring
            t0 = time.thread_time()
            if n:
                self._score([self._pending.popleft() for _ in range(n)])
            spent = time.thread_time() - t0
            self.cpu_s += time.thread_time() - t_setup
            self.scored += n
            with self._done:
                self._handled += n
                self._done.notify_all()
            wait = max(DRIFT_PERIOD_S, spent / DRIFT_CPU_SHARE)

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

    def _score(self, items: list[Any]) -> None:
        """Score ``items`` in order (a bad signature, counted as missing on the request path, is skipped; so are
        cells of a routing model no longer current)."""
        from eldr_cli.handoff import decode_counts

        mon = self._current()
        model = self.state.model
        if mon is None or model is None:
            return
        run: list[Any] = []  # consecutive rows of one kind, scored together, the runs in order
        live = False  # the run's kind: eldr-live's cells with the prototype its decision found, or signatures
        for enc in items:
            if isinstance(enc, tuple):
                if enc[0] is not model:
                    continue
                row: Any = (enc[1], enc[2]) if len(enc) > 2 and enc[2] >= 0 else enc[1]
            else:
                try:
                    c = enc if isinstance(enc, np.ndarray) else decode_counts(enc)
                except Exception:  # noqa: BLE001
                    continue
                if c.shape != model.shape:
                    continue
                row = model.signature(c, unit=False)
            if run and isinstance(row, tuple) != live:
                self._score_run(mon, run, live)
                run = []
            live = isinstance(row, tuple)
            run.append(row)
        if run:
            self._score_run(mon, run, live)

    def _score_run(self, mon: DriftMonitor, run: list[Any], live: bool) -> None:
        with self._lock:
            if live:  # one compiled pass over each request's cells
                mon.observe_cells([r[0] for r in run], [r[1] for r in run])
            else:  # model.signature(..., unit=False) of their counts, value for value
                mon.observe_batch(np.stack(run), unit=False)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until every signature queued before this call is scored (tests, shutdown)."""
        if not self._thread.is_alive():
            return
        target = self._offered
        self._wake.set()
        with self._done:
            self._done.wait_for(lambda: self._handled >= target, timeout_s)

    def snapshot(self) -> dict[str, Any] | None:
        with self._lock:
            mon = self._monitor
            return None if mon is None else mon.snapshot()

    def close(self) -> None:
        """Stop the thread once the signatures already queued are scored."""
        if self._thread.is_alive():
            self._stop = True
            self._wake.set()
            self._thread.join(10.0)
            if self._pending:
                self._score([self._pending.popleft() for _ in range(len(self._pending))])


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
        c = CounterMetricFamily("eldr_proxy_drift_scored", "Signatures scored by the drift watch")
        c.add_metric([], self.watch.scored)
        yield c
        c = CounterMetricFamily("eldr_proxy_drift_cpu_seconds", "CPU time of the drift watch's thread (bounded to "
                                "DRIFT_CPU_SHARE of one core)")
        c.add_metric([], self.watch.cpu_s)
        yield c

