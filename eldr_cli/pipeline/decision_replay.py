"""A proxy's decision log as a trace: what `eldr report --decision-log` (:mod:`eldr_cli.report.decision_log`)
replays and `eldr fit --from-decision-log` (:mod:`eldr_cli.pipeline.refit`) refits on.

The log's replay rows (`eldr serve-proxy --decision-log-replay`, see :mod:`eldr_cli.proxy.decisionlog`) give
each request's arrival, prompt tokens, output budget and handed-off prefill counts. A log holds no decode
steps, so each request's per-step decode picks are GENERATED: top-k draws per layer from its own prefill
distribution mixed half and half with the log's mean one (``DECODE_MIX``). The arrival process of every seed
is a gamma renewal process with the logged gaps' coefficient of variation (``arrival_burstiness``), scaled to
each rate the capacity search tries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from eldr_cli.errors import EldrError

REPLAY_OPTION = "eldr serve-proxy --decision-log FILE --decision-log-replay"
DECODE_MIX = 0.5   # weight of the request's own prefill distribution in its GENERATED decode distribution
MAX_STEPS = 1024   # decode steps generated per request at most


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` decision log (a last line cut off by a crash is dropped and counted under
    ``_truncated``) or of a ``.parquet`` one's numbered part files, each checked against the row's schema
    (``manifests/decision-log.v2.schema.json``)."""
    p = Path(path)
    if p.suffix == ".parquet" or (not p.exists() and p.with_suffix(".parquet").parent.is_dir()
                                  and any(p.parent.glob(f"{p.stem}-*.parquet"))):
        rows = _read_parquet(p)
        check_rows(rows, p, "row")
        return rows
    if not p.is_file():
        raise EldrError(f"decision log {p} does not exist", hint=f"write one with `{REPLAY_OPTION}`")
    rows, lines = [], p.read_bytes().split(b"\n")
    cut = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if n == len(lines):  # no newline after it: the writer stopped mid-row
                cut += 1
                continue
            raise EldrError(f"decision log {p}, line {n}: not a JSON row") from None
        if not isinstance(row, dict):
            raise EldrError(f"decision log {p}, line {n}: not a JSON object")
        rows.append(row)
    check_rows(rows, p, "line", [n for n, line in enumerate(lines, 1) if line.strip()])
    if rows:
        rows[0]["_truncated"] = cut
    return rows


def check_rows(rows: list[dict[str, Any]], path: Path, unit: str, numbers: list[int] | None = None) -> None:
    """Every row against the decision log's row schema (:data:`eldr_cli.proxy.decisionlog.ROW_SCHEMA`); the first
    that does not match is one message naming its line (or row) and field."""
    import jsonschema

    from eldr_cli.artifacts.schema import load_schema
    from eldr_cli.proxy.decisionlog import ROW_SCHEMA

    v = jsonschema.Draft202012Validator(load_schema(ROW_SCHEMA))
    for i, row in enumerate(rows):
        err = next(iter(v.iter_errors(row)), None)
        if err is not None:
            where = "/".join(str(x) for x in err.absolute_path) or "(top level)"
            n = numbers[i] if numbers is not None else i + 1
            raise EldrError(f"decision log {path}, {unit} {n} does not match {ROW_SCHEMA} at {where}: {err.message}",
                            hint="a decision log is written by `eldr serve-proxy --decision-log FILE`; "
                                 "do not edit its rows")


def _read_parquet(p: Path) -> list[dict[str, Any]]:
    import polars as pl

    parts = sorted(p.parent.glob(f"{p.stem}-*.parquet")) or ([p] if p.is_file() else [])
    if not parts:
        raise EldrError(f"decision log {p} has no part files ({p.stem}-00000.parquet, ...)",
                        hint=f"write one with `{REPLAY_OPTION}`")
    try:
        return pl.concat([pl.read_parquet(x) for x in parts], how="diagonal_relaxed").to_dicts()
    except Exception as e:  # noqa: BLE001 - any unreadable part is one message
        raise EldrError(f"decision log {p}: cannot read its part files: {e}") from None


def replay_rows(rows: list[dict[str, Any]], path, routing_id: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rows decided with the routing artifact ``routing_id`` that carry a signature, in arrival order, and
    the counts of the rows skipped by reason. Raises naming the option that writes the fields."""
    from eldr_cli.proxy.decisionlog import REPLAY_FIELDS

    if not rows:
        raise EldrError(f"decision log {path} is empty", hint=f"serve some traffic with `{REPLAY_OPTION}`")
    skipped = {"truncated": int(rows[0].pop("_truncated", 0) or 0), "without replay fields": 0,
               "other routing artifact": 0, "without signature": 0}
    keep: list[dict[str, Any]] = []
    others: dict[str, int] = {}
    for r in rows:
        # sig, prompt_tokens, max_tokens and routing_id may be null (no signature handed off, no usage, no
        # output budget asked for, no routing artifact); arrival_s may not
        if any(f not in r for f in REPLAY_FIELDS) or r["arrival_s"] is None:
            skipped["without replay fields"] += 1
        elif r["routing_id"] != routing_id:
            skipped["other routing artifact"] += 1
            others[r["routing_id"]] = others.get(r["routing_id"], 0) + 1
        elif not isinstance(r.get("sig"), dict):
            skipped["without signature"] += 1
        else:
            keep.append(r)
    if skipped["without replay fields"] == len(rows):
        missing = [f for f in REPLAY_FIELDS if f not in rows[0]]
        raise EldrError(f"decision log {path} lacks the fields a replay needs ({', '.join(missing) or 'values'}): "
                        "it was written by an older proxy or without --decision-log-replay",
                        hint=f"serve with `{REPLAY_OPTION}` and report on that log")
    if not keep:
        ids = ", ".join(f"{k} ({v} rows)" for k, v in others.items()) or "none"
        raise EldrError(f"no row of decision log {path} was decided with the routing artifact given (id "
                        f"{routing_id}) and carries a signature; the log's artifacts: {ids}",
                        hint="pass the --fit (routing artifact) the proxy served with")
    if len(keep) < 2:
        raise EldrError(f"decision log {path} has only {len(keep)} replayable row; a replay needs at least 2")
    keep.sort(key=lambda r: r["arrival_s"])
    return keep, skipped


def arrival_facts(arrival_s: np.ndarray) -> dict[str, float]:
    """Mean rate (req/s) and the gamma shape with the logged gaps' coefficient of variation (1: Poisson)."""
    gaps = np.diff(np.sort(np.asarray(arrival_s, dtype=np.float64)))
    span = float(arrival_s.max() - arrival_s.min())
    if span <= 0 or gaps.size < 2 or gaps.mean() <= 0:
        raise EldrError("the decision log's arrivals span no time; a replay needs requests logged over a while")
    cv2 = float(gaps.var() / gaps.mean() ** 2)
    return {"rate_rps": gaps.size / span, "burstiness": float(np.clip(1.0 / max(cv2, 1e-3), 0.05, 20.0)),
            "gap_cv": cv2 ** 0.5, "span_s": span}


def trace_from_rows(rows: list[dict[str, Any]], shape: tuple[int, int], seed: int = 0):
    """A :class:`eldr_cli.artifacts.trace.Trace` of the logged requests with GENERATED decode picks."""
    import polars as pl

    from eldr_cli.artifacts.trace import Trace
    from eldr_cli.handoff import SignatureDecodeError, decode_counts

    L, E = shape
    R = len(rows)
    pc = np.empty((R, L, E), dtype=np.int32)
    for i, r in enumerate(rows):
        try:
            c = decode_counts({"v": 1, "encoding": "zlib+b64", **r["sig"]})
        except SignatureDecodeError as e:
            raise EldrError(f"decision log row {r.get('request_id')}: {e}") from None
        if c.shape != (L, E):
            raise EldrError(f"decision log row {r.get('request_id')}: signature of shape {c.shape}, the routing "
                            f"artifact's is {(L, E)}")
        pc[i] = c
    per_layer = np.maximum(pc.sum(axis=2), 1)                              # [R, L] prompt tokens x top-k
    tokens = np.array([r.get("prompt_tokens") or 0 for r in rows])
    has = tokens > 0
    k = int(round(float(np.median(per_layer[has, 0] / tokens[has])))) if has.any() else 1
    k = max(1, min(k, E))
    tokens = np.where(has, tokens, np.maximum(per_layer[:, 0] // k, 1)).astype(np.int32)
    asked = [r["max_tokens"] for r in rows if isinstance(r.get("max_tokens"), int) and r["max_tokens"] > 0]
    typical = int(np.median(asked)) if asked else 16  # vLLM's completions default when nobody asked
    steps = np.clip(np.array([r.get("max_tokens") or typical for r in rows]), 1, MAX_STEPS).astype(np.int32)
    picks, offsets, dc = _generated_picks(pc, per_layer, steps, k, seed)
    dom = [str(r.get("domain")) if r.get("domain") is not None else "unlabelled" for r in rows]
    requests = pl.DataFrame({"request_id": [str(r.get("request_id")) for r in rows], "domain": dom,
                             "language": [""] * R, "prompt_tokens": tokens, "decode_tokens": steps,
                             "source": ["decision-log"] * R, "split": ["evaluation"] * R, "prompt": [""] * R})
    return Trace(prefill_counts=pc, decode_counts=dc, decode_steps=steps, requests=requests,
                 model={"model": "decision-log", "num_layers": L, "num_experts": E, "top_k": k,
                        "moe_layer_ids": list(range(L))},
                 decode_picks=picks, decode_offsets=offsets)


def _generated_picks(pc, per_layer, steps, k: int, seed: int):
    """GENERATED per-step picks: k distinct experts per layer (Gumbel top-k) from each request's decode
    distribution, its prefill one mixed with the log's mean (DECODE_MIX)."""
    R, L, E = pc.shape
    rng = np.random.default_rng([seed, 0xDEC0DE])
    own = pc / per_layer[:, :, None]
    q = DECODE_MIX * own + (1 - DECODE_MIX) * own.mean(axis=0, keepdims=True)
    logq = np.log(q + 1e-9)
    offsets = np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)
    picks = np.empty((int(offsets[-1]), L, k), dtype=np.int16)
    dc = np.zeros((R, L, E), dtype=np.int32)
    for r in range(R):
        g = logq[r][None] + rng.gumbel(size=(int(steps[r]), L, E))
        p = np.argpartition(-g, k - 1, axis=2)[:, :, :k]
        picks[offsets[r]:offsets[r + 1]] = p
        idx = (np.arange(L)[None, :, None] * E + p).ravel()
        dc[r] = np.bincount(idx, minlength=L * E).reshape(L, E)
    return picks, offsets, dc
