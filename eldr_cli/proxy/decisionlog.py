"""Optional decision log for offline replay: one row per decode routing decision.

Row: ts (unix s), request_id, policy, tau, signature ("ok"|"missing"|"malformed"), similarities [K]
(eldr only), band [worker positions] (eldr's locality band), predicted_ms [K] (eldr-live), loads [K] as
seen by the policy, chosen (position of the worker used), worker (its id), first (id of the ranking's first
choice: differs from worker when it was down or the replicas' reservation moved the request), domain,
decision_us. ``.jsonl`` files are appended
line by line; ``.parquet`` paths get numbered part files ``<stem>-00000.parquet`` every ``rows_per_part``
rows and at shutdown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson


def decision_row(d: Any, rid: str, policy: str, tau: float | None, signature: str, loads: Any, worker_id: str,
                 domain: str | None, seconds: float, first_id: str | None = None) -> dict[str, Any]:
    """The row of one decision (``d``: an :class:`eldr_cli.routing.Decision`)."""
    return {"ts": time.time(), "request_id": rid, "policy": policy, "tau": tau, "signature": signature,
            "similarities": None if d.similarities is None else d.similarities.tolist(),
            "band": None if d.band is None else d.band.tolist(),
            "predicted_ms": None if d.predicted_ms is None else [round(float(x), 4) for x in d.predicted_ms],
            "loads": [int(x) for x in loads], "chosen": d.worker, "worker": worker_id,
            "first": worker_id if first_id is None else first_id,
            "domain": domain, "decision_us": round(seconds * 1e6, 2)}


class DecisionLog:
    def __init__(self, path: str, rows_per_part: int = 10000):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.parquet = self.path.suffix == ".parquet"
        self.rows_per_part = rows_per_part
        self._rows: list[dict[str, Any]] = []
        self._part = 0
        self._fh = None if self.parquet else open(self.path, "ab", buffering=1 << 16)

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            return
        self._rows.append(row)
        if len(self._rows) >= self.rows_per_part:
            self._flush_parquet()

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
        pl.DataFrame(rows, infer_schema_length=None).write_parquet(out)
        self._part += 1
        self._rows = []

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        else:
            self._flush_parquet()
