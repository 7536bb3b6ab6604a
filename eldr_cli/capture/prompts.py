"""Prompt input for capture: JSONL, Parquet or CSV with a ``prompt`` column or chat ``messages``.

Optional columns ``id``, ``domain``, ``language``, ``source``. Selection is ``--limit`` (first N
rows) then ``--sample N --seed S`` (uniform without replacement, file order kept), then a
disjoint calibration/evaluation split, stratified by domain and seeded, so later stages
(fit on ``calibration``, evaluate on ``evaluation``) cannot leak.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
           ".csv": "csv"}


@dataclass
class PromptRow:
    request_id: str
    text: str
    domain: str = "unknown"
    language: str = "und"
    source: str = ""
    split: str = "calibration"


def _read_rows(path: Path) -> list[dict]:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise EldrError(f"{path}: unknown prompt file type {path.suffix!r}",
                        hint="use .jsonl, .parquet or .csv with a 'prompt' (or 'messages') column")
    if fmt == "jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EldrError(f"{path}:{n}: not valid JSON ({e.msg})",
                                    hint="one JSON object per line (JSON Lines)") from None
                if not isinstance(row, dict):
                    raise EldrError(f"{path}:{n}: expected a JSON object per line, got {type(row).__name__}")
                rows.append(row)
        return rows
    import polars as pl

    try:
        df = pl.read_parquet(path) if fmt == "parquet" else pl.read_csv(path, infer_schema_length=0)
    except Exception as e:  # polars raises many types for corrupt files
        raise EldrError(f"{path}: cannot read as {fmt}: {str(e).splitlines()[0]}") from None
    return df.to_dicts()


def render_messages(messages, tokenizer) -> str:
    """Chat ``messages`` -> one prompt string (the tokenizer's chat template when it has one)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise EldrError("'messages' must be a list of {role, content} objects")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages)


def load_prompts(path, *, tokenizer=None, limit: int | None = None, sample: int | None = None, seed: int = 0,
                 eval_fraction: float = 0.0, exclude_ids: set[str] | None = None) -> list[PromptRow]:
    """Read, select and split prompts. Raises EldrError for missing/empty/malformed files.

    ``exclude_ids``: prompt ids dropped before ``limit``/``sample`` (a trained model's training
    prompts, so calibration and serving never see text the model was trained on).
    """
    path = Path(path)
    if not path.exists():
        raise EldrError(f"prompts file {path} does not exist")
    if path.is_dir():
        raise EldrError(f"prompts file {path} is a directory", hint="pass a .jsonl, .parquet or .csv file")
    if path.stat().st_size == 0:
        raise EldrError(f"prompts file {path} is empty")
    if not 0.0 <= eval_fraction < 1.0:
        raise EldrError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    rows = _read_rows(path)
    if not rows:
        raise EldrError(f"prompts file {path} has no rows")
    cols = set().union(*(r.keys() for r in rows[:1000]))
    if "prompt" not in cols and "messages" not in cols:
        raise EldrError(f"prompts file {path} has no 'prompt' or 'messages' column (columns: {sorted(cols)})",
                        hint="name the prompt text column 'prompt', or give chat turns as 'messages'")
    if exclude_ids:
        rows = [r for r in rows if r.get("id") is None or str(r["id"]) not in exclude_ids]
        if not rows:
            raise EldrError(f"every prompt in {path} is in the model's training split",
                            hint="use other prompts, or --include-training")
    if limit is not None:
        if limit < 1:
            raise EldrError(f"--limit must be >= 1, got {limit}")
        rows = rows[:limit]
    if sample is not None:
        if sample < 1:
            raise EldrError(f"--sample must be >= 1, got {sample}")
        if sample < len(rows):
            keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=sample, replace=False))
            rows = [rows[i] for i in keep]
    out: list[PromptRow] = []
    seen: set[str] = set()
    for i, r in enumerate(rows):
        if r.get("prompt") is not None:
            text = r["prompt"]
            if not isinstance(text, str):
                raise EldrError(f"{path}: row {i}: 'prompt' must be a string, got {type(text).__name__}")
        elif r.get("messages") is not None:
            msgs = r["messages"]
            if isinstance(msgs, str):
                try:
                    msgs = json.loads(msgs)
                except json.JSONDecodeError:
                    raise EldrError(f"{path}: row {i}: 'messages' is not a JSON list") from None
            text = render_messages(msgs, tokenizer)
        else:
            raise EldrError(f"{path}: row {i} has neither 'prompt' nor 'messages'")
        rid = str(r["id"]) if r.get("id") is not None else f"{path.stem}/{i}"
        if rid in seen:
            raise EldrError(f"{path}: duplicate request id {rid!r}", hint="ids must be unique")
        seen.add(rid)
        out.append(PromptRow(rid, text, str(r.get("domain") or "unknown"), str(r.get("language") or "und"),
                             str(r.get("source") or path.name)))
    assign_split([p.domain for p in out], eval_fraction, seed, out)
    return out


def assign_split(domains: list[str], eval_fraction: float, seed: int, rows=None) -> np.ndarray:
    """Boolean [R] evaluation mask: per domain, round(fraction * n) seeded picks (disjoint by design)."""
    d = np.asarray(domains, dtype=object)
    is_eval = np.zeros(len(d), dtype=bool)
    if eval_fraction > 0:
        rng = np.random.default_rng([seed, 0x5EED])
        for dom in sorted(set(d.tolist())):
            idx = np.flatnonzero(d == dom)
            n = int(round(eval_fraction * len(idx)))
            if len(idx) > 1:
                n = min(max(n, 1), len(idx) - 1)
            else:
                n = 0
            is_eval[rng.choice(idx, size=n, replace=False)] = True
    if rows is not None:
        for r, e in zip(rows, is_eval, strict=True):
            r.split = "evaluation" if e else "calibration"
    return is_eval


def selection_hash(rows: list[PromptRow]) -> str:
    """Hash of the selected requests (ids, texts, splits): resume refuses a different selection."""
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r.request_id}\0{r.split}\0".encode())
        h.update(hashlib.sha256(r.text.encode()).digest())
    return h.hexdigest()
