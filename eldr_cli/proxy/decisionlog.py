"""Optional decision log for offline replay: one row per decode routing decision
(:meth:`eldr_cli.proxy.dispatch.DecisionRecord.row`; schema ``manifests/decision-log.v2.schema.json``).

Row: ts (unix s), request_id, policy, tau, signature ("ok"|"missing"|"malformed"), similarities [K]
(eldr only), band [worker positions] (eldr's locality band), predicted_ms [K] (eldr-live), loads [K] as
seen by the policy, chosen (position of the worker used), worker (its id), first (id of the ranking's first
choice: differs from worker when it was down or the replicas' reservation moved the request), domain,
decision_us. ``.jsonl`` files are appended
line by line; ``.parquet`` paths get numbered part files ``<stem>-00000.parquet`` every ``rows_per_part``
rows and at shutdown.

With ``--decision-log-replay`` each row also carries what `eldr report --decision-log` and `eldr fit
--from-decision-log` need to rebuild the traffic (:data:`REPLAY_FIELDS`): ``log_v``, ``arrival_s`` (unix s
at which the proxy received the request), ``prompt_tokens`` (the prefill answer's usage), ``max_tokens``
(the request's output budget), ``sig`` (the handed-off prefill counts exactly as they arrived, the
``zlib+b64`` encoding of :mod:`eldr_cli.handoff`, without the version keys) and ``routing_id`` (the first 16
hex digits of the content hash of the routing artifact that decided). See docs/commands/serve-proxy.md for
the size per request.

Writing is off the request path: :meth:`DecisionLog.write` puts the row on a bounded queue that one writer
thread serializes and writes. A full queue or a failing disk (full, read-only) never fails a request: the
rows are dropped, counted in :attr:`DecisionLog.dropped` (``eldr_proxy_decision_log_dropped_total``), and
the first failure is logged once.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import orjson

from eldr_cli.proxy.background import QueueThread

LOG_VERSION = 2  # 1: rows without the replay fields
ROW_SCHEMA = f"decision-log.v{LOG_VERSION}.schema.json"  # manifests/: what `eldr report --decision-log` checks
REPLAY_FIELDS = ("log_v", "arrival_s", "prompt_tokens", "max_tokens", "sig", "routing_id")
QUEUE_ROWS = 65536
log = logging.getLogger("eldr.proxy")


@functools.lru_cache(maxsize=16)
def routing_id(path: str | None) -> str | None:
    """The identity of a routing artifact in the log: the first 16 hex digits of its content hash."""
    if not path:
        return None
    from eldr_cli.artifacts.store import read_manifest
    from eldr_cli.routing.model import load_routing_artifact

    art = load_routing_artifact(path)  # type: ignore[no-untyped-call]
    return str(read_manifest(art.path)["content_hash"])[:16]


def replay_fields(t0_perf: float, answer: dict[str, Any], body: dict[str, Any], enc: Any,
                  routing_path: str | None) -> dict[str, Any]:
    """The replay fields of one request (``t0_perf``: its ``time.perf_counter()`` at arrival; ``answer``: the
    prefill answer; ``enc``: the handed-off signature as it arrived, or None)."""
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    out = body.get("max_completion_tokens", body.get("max_tokens"))
    sig = None
    if isinstance(enc, dict):
        sig = {k: enc.get(k) for k in ("shape", "dtype", "data")}
        if "tokens" in enc:
            sig["tokens"] = enc["tokens"]
    return {"log_v": LOG_VERSION, "arrival_s": round(time.time() - (time.perf_counter() - t0_perf), 6),
            "prompt_tokens": prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None,
            "max_tokens": out if isinstance(out, int) and not isinstance(out, bool) else None,
            "sig": sig, "routing_id": routing_id(routing_path)}


class DecisionLog:
    """The proxy's decision log: rows queued by the request path, written by one thread."""

    def __init__(self, path: str, rows_per_part: int = 10000, *, replay: bool = False,
                 queue_rows: int = QUEUE_ROWS):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.parquet = self.path.suffix == ".parquet"
        self.rows_per_part = rows_per_part
        self.replay = replay
        self.dropped = 0          # rows lost to a full queue or a failing disk
        self.written = 0
        self._rows: list[dict[str, Any]] = []
        self._part = 0
        self._failed = False      # the first failure is logged, the rest only counted
        self._fh = None if self.parquet else open(self.path, "ab", buffering=1 << 16)
        self._worker = QueueThread("eldr-decision-log", self._write_row, queue_rows, on_drain=self._flush_file)
        self._worker.start()

    def write(self, row: dict[str, Any]) -> None:
        """Queue one row (never blocks, never raises: a full queue drops the row and counts it)."""
        if not self._worker.offer(row):
            self._drop(1, "the writer is behind (queue full)")

    def _drop(self, n: int, why: str) -> None:
        self.dropped += n
        if not self._failed:
            self._failed = True
            log.warning("decision log %s: %s; dropping rows (counted in eldr_proxy_decision_log_dropped_total), "
                        "requests are served as usual", self.path, why)

    def _write_row(self, row: dict[str, Any]) -> None:
        try:
            if self._fh is not None:
                self._fh.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            else:
                self._rows.append(row)
                if len(self._rows) >= self.rows_per_part:
                    self._flush_parquet()
            self.written += 1
        except (OSError, TypeError, ValueError) as e:
            self._drop(1, f"{type(e).__name__}: {e}")

    def _flush_file(self) -> None:
        if self._fh is None:
            return
        try:
            self._fh.flush()
        except OSError as e:
            self._drop(0, f"{type(e).__name__}: {e}")

    def _flush_parquet(self) -> None:
        if not self._rows:
            return
        import polars as pl

        def floats(v: Any) -> list[float] | None:
            return None if v is None else [float(x) for x in v]

        def ints(v: Any) -> list[int] | None:
            return None if v is None else [int(x) for x in v]

        rows = [{**r, "similarities": floats(r.get("similarities")), "band": ints(r.get("band")),
                 "loads": ints(r.get("loads"))} for r in self._rows]
        out = self.path.with_name(f"{self.path.stem}-{self._part:05d}.parquet")
        n, self._rows = len(rows), []
        try:
            pl.DataFrame(rows, infer_schema_length=None).write_parquet(out)
            self._part += 1
        except OSError as e:
            self.written -= min(self.written, n)
            self._drop(n, f"{type(e).__name__}: {e}")

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until every queued row is written and the file flushed."""
        self._worker.drain(timeout_s)

    def close(self) -> None:
        self._worker.close(30.0)
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as e:
                self._drop(0, f"{type(e).__name__}: {e}")
            self._fh = None
        else:
            self._flush_parquet()


class DecisionLogCollector:
    """``eldr_proxy_decision_log_rows_total`` (written) and ``eldr_proxy_decision_log_dropped_total``."""

    def __init__(self, dlog: DecisionLog):
        self.dlog = dlog

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        c = CounterMetricFamily("eldr_proxy_decision_log_rows", "Decision-log rows written")
        c.add_metric([], self.dlog.written)
        yield c
        c = CounterMetricFamily("eldr_proxy_decision_log_dropped", "Decision-log rows dropped (writer behind, "
                                "disk full or failing); requests are served as usual")
        c.add_metric([], self.dlog.dropped)
        yield c
