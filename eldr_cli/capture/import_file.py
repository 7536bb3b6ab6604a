"""One file of a trace import: read, parse, hash, label (the work ``--workers`` processes share out).

Everything here depends on the file alone, so it runs in the parser processes; the main process
only checks the files agree with each other and stages the rows (``import_trace``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.capture.oic_parse import fast_parse as _fast_parse


class BadTraceFile(Exception):
    pass


def parse_trace_file(path: str):
    """-> (layer_ids tuple, prefill_counts int32 [L, E'], decode_picks int16 [N, L, k], prompt_tokens, E').

    E' is the largest id in the file + 1. Raises BadTraceFile with a reason for malformed content.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadTraceFile(f"unreadable ({e})") from None
    return parse_trace_bytes(raw)


def parse_trace_bytes(raw: bytes):
    """:func:`parse_trace_file` on bytes already read."""
    import orjson

    fast = _fast_parse(raw)
    if fast is not None:
        return fast
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadTraceFile(f"not valid JSON ({e})") from None
    if not isinstance(doc, list) or not doc or not isinstance(doc[0], dict):
        raise BadTraceFile("expected a list whose element 0 maps layer ids to per-token expert lists")
    pre = doc[0]
    try:
        layers = sorted((int(k) for k, v in pre.items() if v is not None))
    except ValueError:
        raise BadTraceFile("layer ids must be integers (as strings)") from None
    if not layers:
        raise BadTraceFile("no MoE layer (all layers null)")
    keys = [str(l) for l in layers]
    try:
        arrs = [np.asarray(pre[k], dtype=np.int64) for k in keys]
    except (ValueError, TypeError):
        raise BadTraceFile("prefill expert lists are ragged or not integers") from None
    T = arrs[0].shape[0] if arrs[0].ndim == 2 else -1
    if T <= 0 or any(a.ndim != 2 or a.shape != arrs[0].shape for a in arrs):
        raise BadTraceFile("prefill: every MoE layer needs the same [tokens, k] expert lists")
    k = arrs[0].shape[1]
    stacked = np.stack(arrs)  # [L, T, k]
    if stacked.min() < 0:
        raise BadTraceFile("negative expert id")
    E = int(stacked.max()) + 1
    L = len(layers)
    flat = stacked.reshape(L, -1) + (np.arange(L) * E)[:, None]
    prefill = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E).astype(np.int32)
    steps = doc[1:]
    picks = np.zeros((len(steps), L, k), dtype=np.int16)
    if steps:
        try:
            rows = [[st[kk][-1] for kk in keys] for st in steps]
            picks_arr = np.asarray(rows, dtype=np.int64)
        except (KeyError, TypeError, IndexError, ValueError):
            raise BadTraceFile("decode steps must map every MoE layer to a [[k ids]] list") from None
        if picks_arr.shape != (len(steps), L, k):
            raise BadTraceFile(f"decode picks have shape {picks_arr.shape}, expected {(len(steps), L, k)}")
        if picks_arr.min() < 0:
            raise BadTraceFile("negative expert id")
        E = max(E, int(picks_arr.max()) + 1)
        picks = np.sort(picks_arr, axis=-1).astype(np.int16)
    if prefill.shape[1] < E:
        prefill = np.concatenate([prefill, np.zeros((L, E - prefill.shape[1]), np.int32)], axis=1)
    return tuple(layers), prefill, picks, T, E


def _labels(root: Path, path: Path) -> tuple[str, str, str, str]:
    """(model key, benchmark, subject, request id) from the path below ``root``."""
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts
    subject = parts[-2] if len(parts) >= 2 else root.name
    bench = parts[-3] if len(parts) >= 3 else (root.parent.name if len(parts) == 2 else root.parent.name)
    model = "/".join(parts[:-3]) if len(parts) >= 4 else ""
    return model, bench, subject, rel.as_posix()


def _rel(root: str, path: str) -> str | None:
    """``path`` relative to ``root`` as a posix string, by string arithmetic: the walk builds every path
    by joining names to the (normalised) root, so no pathlib parse is needed. None if it is not below."""
    prefix = root if root.endswith(os.sep) else root + os.sep
    if os.sep != "/" or not path.startswith(prefix):
        return None
    return path[len(prefix):]


def _labels_fast(root: Path, root_s: str, path: str) -> tuple[str, str, str, str]:
    """:func:`_labels` without pathlib for the paths the walk yields (same result)."""
    rel = _rel(root_s, path)
    if rel is None or not rel or "//" in rel:
        return _labels(root, Path(path))
    parts = rel.split("/")
    name = parts[-1]
    dot = name.rfind(".")
    if 0 < dot < len(name) - 1:  # pathlib's suffix rule (with_suffix(""))
        parts[-1] = name[:dot]
    subject = parts[-2] if len(parts) >= 2 else root.name
    bench = parts[-3] if len(parts) >= 3 else root.parent.name
    model = "/".join(parts[:-3]) if len(parts) >= 4 else ""
    return model, bench, subject, "/".join(parts)


@dataclass(frozen=True)
class _Job:
    """What a parser process needs besides the file (sent once per batch of files)."""
    root: Path
    seed: int
    eval_fraction: float


def _parse_for_import(job: _Job, task: tuple[str, bool]):
    """Everything per file that does not depend on the other files, so it runs in the parser processes:
    read, parse, the file's sha256 (for the source tree's input hash, from the bytes already read),
    labels, split, decode counts. -> (path, error or None, digest or None, row or None) where row =
    (layer ids, prefill [L, E'], decode counts [L, E'], picks [N, L, k], T, E', model key, request row)."""
    path, want_digest = task
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        return path, f"unreadable ({e})", None, None
    digest = hashlib.sha256(raw).hexdigest() if want_digest else None
    try:
        layers, prefill, picks, T, E = parse_trace_bytes(raw)
    except BadTraceFile as e:
        return path, str(e), digest, None
    L = len(layers)
    if picks.size:
        flat = picks.astype(np.int64) + (np.arange(L) * E)[None, :, None]
        dec = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E).astype(np.int32)
    else:
        dec = np.zeros((L, E), np.int32)
    mk, bench, subject, rid = _labels_fast(job.root, str(job.root), path)
    split = "evaluation" if _is_eval(rid, job.seed, job.eval_fraction) else "calibration"
    row = {"request_id": rid, "domain": subject, "language": "und", "prompt_tokens": T,
           "decode_tokens": picks.shape[0], "source": bench, "split": split, "prompt": ""}
    return path, None, digest, (layers, prefill, dec, picks, T, E, mk, row)


def _is_eval(request_id: str, seed: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}\0{request_id}".encode(), digest_size=8).digest(), "big")
    return h / 2.0 ** 64 < fraction


def warm_up() -> None:
    """Load (or compile) the fast parser now."""
    from eldr_cli.capture import oic_parse

    oic_parse.load()


def stage_batch(job: _Job, staging: str, batch: tuple[int, list[tuple[str, bool]]]):
    """A batch of files -> the arrays of staging chunk ``chunk``, written by the process that parsed
    them (so the main process handles no arrays: with ``--workers 2`` it was the limit). -> (chunk,
    results, rows, aggregates): chunk is None if no arrays were written (no file parsed, or files that
    disagree, which the main process then names); results one (path, error or None, digest or None,
    facts or None) per file in order, facts = (layer ids, k, E', model key); rows the request rows of
    the parsed files (the main process writes them: polars does not survive a fork); aggregates the
    chunk's sums for the figures (:class:`Aggregates`, merged by the main process), or None."""
    from eldr_cli.capture.figures import Aggregates
    from eldr_cli.capture.staging import write_chunk_arrays

    chunk, tasks = batch
    results: list[tuple] = []
    parsed: list[tuple] = []
    for task in tasks:
        path, err, digest, p = _parse_for_import(job, task)
        if p is None:
            results.append((path, err, digest, None))
            continue
        layers, _prefill, _dec, picks, _T, E, mk, _row = p
        results.append((path, None, digest, (layers, picks.shape[2], E, mk)))
        parsed.append(p)
    if not parsed or len({(p[0], p[3].shape[2]) for p in parsed}) > 1:
        return None, results, [], None
    arrays = chunk_arrays(parsed)
    write_chunk_arrays(Path(staging), chunk, arrays)
    rows = [p[7] for p in parsed]
    pre = arrays["prefill_counts"]
    agg = Aggregates(pre.shape[1], pre.shape[2], parsed[0][3].shape[2])
    agg.update(pre, arrays["decode_counts"], arrays["prompt_tokens"], arrays["decode_steps"],
               [r["domain"] for r in rows])
    return chunk, results, rows, agg


def chunk_arrays(parsed: list) -> dict[str, np.ndarray]:
    """The staging arrays of parsed files of one model (same layers and k), experts padded to the
    largest E' among them."""
    E = max(p[1].shape[1] for p in parsed)
    L = parsed[0][1].shape[0]
    pre = np.zeros((len(parsed), L, E), dtype=np.int32)
    dec = np.zeros((len(parsed), L, E), dtype=np.int32)
    for i, (_layers, prefill, dcounts, _picks, _T, _E, _mk, _row) in enumerate(parsed):
        pre[i, :, :prefill.shape[1]] = prefill
        dec[i, :, :dcounts.shape[1]] = dcounts
    return {"prefill_counts": pre, "decode_counts": dec,
            "decode_steps": np.array([p[3].shape[0] for p in parsed], dtype=np.int32),
            "prompt_tokens": np.array([p[4] for p in parsed], dtype=np.int32),
            "decode_picks": np.concatenate([p[3] for p in parsed])}
