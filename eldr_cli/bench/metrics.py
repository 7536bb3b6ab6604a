"""Per-request records and the run summary, with the result keys of `vllm bench serve`
(``median_tpot_ms``, ``p99_tpot_ms``, ``mean_ttft_ms``, ...).

Definitions (as vLLM): TTFT = first streamed token - send time; TPOT = (E2EL - TTFT) / (output
tokens - 1) for requests with > 1 output token; ITL = gaps between successive streamed tokens;
E2EL = last token - send time. Latency percentiles cover the *completed* measured requests; failed
ones are counted (``failed``, ``failed_by_outcome``, ``success_rate``) and printed in every table --
never silently dropped. Requests sent during warm-up are recorded (``warmup=True``) but not summarized.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
OUTCOMES = ("ok", "http_error", "timeout", "connect_error", "incomplete", "error")

REQUEST_SCHEMA = {
    "request_id": "str", "router": "str", "request_rate": "f64", "prompt_index": "i64", "domain": "str",
    "scheduled_s": "f64", "sent_s": "f64", "lag_ms": "f64", "ttft_ms": "f64", "tpot_ms": "f64",
    "e2el_ms": "f64", "itl_ms": "list[f64]", "prompt_tokens": "i64", "output_tokens": "i64",
    "outcome": "str", "error": "str", "warmup": "bool", "decode_worker": "i64",
}


def requests_frame(rows: list[dict]):
    import polars as pl

    dt: dict[str, Any] = {"str": pl.Utf8, "f64": pl.Float64, "i64": pl.Int64, "bool": pl.Boolean,
                          "list[f64]": pl.List(pl.Float64)}
    schema = {k: dt[v] for k, v in REQUEST_SCHEMA.items()}
    cols = {k: [r.get(k) for r in rows] for k in schema}
    return pl.DataFrame(cols, schema=schema)


def requests_frame_from_columns(cols: dict, n: int):
    """The same frame from columns (numpy arrays or lists; None = all null); NaN floats become null."""
    import polars as pl

    dt: dict[str, Any] = {"str": pl.Utf8, "f64": pl.Float64, "i64": pl.Int64, "bool": pl.Boolean,
                          "list[f64]": pl.List(pl.Float64)}
    series = []
    for k, v in REQUEST_SCHEMA.items():
        c = cols.get(k)
        if c is None:
            series.append(pl.Series(k, [None] * n, dtype=dt[v]))
        else:
            s = pl.Series(k, c, dtype=dt[v], strict=False)
            if v == "f64":
                s = s.fill_nan(None)
            series.append(s)
    return pl.DataFrame(series)


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cw = np.cumsum(w)
    if cw[-1] <= 0:
        return float("nan")
    # linear interpolation between order statistics of the expanded sample (numpy's default)
    pos = q / 100.0 * (cw[-1] - 1)
    lo = int(np.floor(pos))
    i = int(np.searchsorted(cw, lo, side="right"))
    j = int(np.searchsorted(cw, min(lo + 1, cw[-1] - 1), side="right"))
    i, j = min(i, len(v) - 1), min(j, len(v) - 1)
    frac = pos - lo
    return float(v[i] + (v[j] - v[i]) * frac)


def _stats(name: str, x: np.ndarray, weights: np.ndarray | None = None) -> dict:
    out: dict[str, Any] = {}
    if x.size == 0 or (weights is not None and weights.sum() <= 0):
        for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{k}_{name}_ms"] = None
        return out
    if weights is None:
        out[f"mean_{name}_ms"] = float(x.mean())
        out[f"median_{name}_ms"] = float(np.median(x))
        out[f"std_{name}_ms"] = float(x.std())
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = float(np.percentile(x, p))
    else:
        w = weights.astype(np.float64)
        mean = float((x * w).sum() / w.sum())
        out[f"mean_{name}_ms"] = mean
        out[f"median_{name}_ms"] = _weighted_percentile(x, w, 50)
        out[f"std_{name}_ms"] = float(np.sqrt((w * (x - mean) ** 2).sum() / w.sum()))
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = _weighted_percentile(x, w, p)
    return out


def summarize(df, *, request_rate: float, router: str, mode: str, burstiness: float = 1.0,
              itl_values: np.ndarray | None = None, itl_weights: np.ndarray | None = None,
              extra: dict | None = None) -> dict:
    """One run's summary over its measured (non-warm-up) requests. ``itl_values``/``itl_weights``
    give the ITL distribution when per-token gaps are not stored per request (simulator)."""
    import polars as pl

    m = df.filter(~pl.col("warmup"))
    ok = m.filter(pl.col("outcome") == "ok")
    n, n_ok = len(m), len(ok)
    outcomes, counts = np.unique(m["outcome"].to_numpy(), return_counts=True)
    by = {o: int(c) for o, c in zip(outcomes, counts, strict=True)} if n else {}
    failed_by = {k: v for k, v in by.items() if k != "ok"}
    out_tok = ok["output_tokens"].to_numpy().astype(np.int64) if n_ok else np.zeros(0, np.int64)
    in_tok = ok["prompt_tokens"].fill_null(0).to_numpy().astype(np.int64) if n_ok else np.zeros(0, np.int64)
    if n:
        start = float(m["sent_s"].min())
        ends = (m["sent_s"] + m["e2el_ms"].fill_null(0.0) / 1e3).to_numpy()
        duration = max(float(np.nanmax(ends)) - start, 1e-9)
    else:
        duration = 0.0
    s = {
        "mode": mode, "router": router, "request_rate": float(request_rate), "burstiness": float(burstiness),
        "num_prompts": n, "completed": n_ok, "failed": n - n_ok, "failed_by_outcome": failed_by,
        "success_rate": (n_ok / n) if n else None, "percentiles_over": "completed measured requests",
        "duration": duration,
        "total_input_tokens": int(in_tok.sum()), "total_output_tokens": int(out_tok.sum()),
        "request_throughput": n_ok / duration if duration else None,
        "output_throughput": float(out_tok.sum()) / duration if duration else None,
        "total_token_throughput": float(out_tok.sum() + in_tok.sum()) / duration if duration else None,
    }
    s.update(_stats("ttft", ok["ttft_ms"].drop_nulls().to_numpy()))
    s.update(_stats("tpot", ok["tpot_ms"].drop_nulls().to_numpy()))
    s.update(_stats("e2el", ok["e2el_ms"].drop_nulls().to_numpy()))
    if itl_values is not None:
        s.update(_stats("itl", np.asarray(itl_values, dtype=np.float64), np.asarray(itl_weights)))
    else:
        itl = ok["itl_ms"].explode().drop_nulls().to_numpy() if n_ok else np.zeros(0)
        s.update(_stats("itl", np.asarray(itl, dtype=np.float64)))
    lag = m["lag_ms"].drop_nulls().to_numpy()
    s["median_schedule_lag_ms"] = float(np.median(lag)) if lag.size else None
    s["p99_schedule_lag_ms"] = float(np.percentile(lag, 99)) if lag.size else None
    s["max_schedule_lag_ms"] = float(lag.max()) if lag.size else None
    s.update(extra or {})
    return s
