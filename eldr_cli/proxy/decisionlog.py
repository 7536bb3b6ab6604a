"""Optional decision log for offline replay: one row per decode routing decision.

Row: ts (unix s), request_id, policy, tau, signature ("ok"|"missing"|"malformed"), similarities [K]
(eldr only), band [worker positions], loads [K] as seen by the policy, chosen (position), worker (id),
domain. ``.jsonl`` files are appended line by line; ``.parquet`` paths get numbered part files
``<stem>-00000.parquet`` every ``rows_per_part`` rows and at shutdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


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
