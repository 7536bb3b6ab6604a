"""Import public per-request expert-selection traces (the Orders-in-Chaos layout) as a trace artifact.

Layout: ``<org>/<model>/<benchmark>/<subject>/<n>.json``; each file is a JSON list whose element 0
is the prefill pass and elements 1..N one decode step each; every element maps a layer id
(string) to a list of per-token lists of k expert ids, or ``null`` for dense layers. The
domain label is the ``<subject>`` directory, the source the ``<benchmark>`` directory.

The import streams: files are found directory by directory, parsed one at a time (or by
``workers`` processes), and flushed in chunks to the same staging area a live capture uses,
so memory does not grow with the number of files. The number of experts is the largest id
seen + 1 unless ``num_experts`` is given. The evaluation split is chosen per request from a
seeded hash of its id (streaming, so not stratified).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.pipeline.oic_parse import fast_parse as _fast_parse

CHUNK_FILES = 256


@dataclass
class ImportResult:
    out: Path
    metrics: dict


class BadTraceFile(Exception):
    pass


def iter_trace_files(root: Path, skipped: list[tuple[Path, str]] | None = None):
    """Yield ``*.json`` files below ``root`` in sorted order, one directory listing at a time.

    Symbolic links to folders and files are followed (trace trees are often assembled from links);
    a folder reached twice (a link loop, or two links to one folder) is walked once. Entries that
    cannot be walked (unreadable folders, broken links, loops) are appended to ``skipped`` as
    (path, reason); without a list they are yielded like files, so the parser counts and names them
    among the unreadable files instead of dropping them silently.
    """
    def skip(p: Path, why: str):
        if skipped is not None:
            skipped.append((p, why))
            return None
        return p

    seen: set[tuple[int, int]] = set()
    stack = [Path(root)]
    while stack:
        d = stack.pop()
        try:
            st = d.stat()
        except OSError as e:
            if (p := skip(d, f"unreadable ({e.strerror})")) is not None:
                yield p
            continue
        if (st.st_dev, st.st_ino) in seen:
            if (p := skip(d, "folder already walked (symbolic link loop or duplicate link)")) is not None:
                yield p
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            entries = sorted(os.scandir(d), key=lambda entry: entry.name)
        except OSError as e:
            if (p := skip(d, f"unreadable folder ({e.strerror})")) is not None:
                yield p
            continue
        dirs = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symbolic links
                is_file = not is_dir and entry.is_file()
            except OSError:
                is_dir = is_file = False
            if is_dir:
                dirs.append(Path(entry.path))
            elif entry.name.endswith(".json"):
                if is_file:
                    yield Path(entry.path)
                elif (p := skip(Path(entry.path), "broken symbolic link or not a file")) is not None:
                    yield p
        stack.extend(reversed(dirs))


def parse_trace_file(path: str):
    """-> (layer_ids tuple, prefill_counts int32 [L, E'], decode_picks int16 [N, L, k], prompt_tokens, E').

    E' is the largest id in the file + 1. Raises BadTraceFile with a reason for malformed content.
    """
    import orjson

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadTraceFile(f"unreadable ({e})") from None
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


def _parse_safe(path: str):
    try:
        return path, parse_trace_file(path), None
    except BadTraceFile as e:
        return path, None, str(e)


def _labels(root: Path, path: Path) -> tuple[str, str, str, str]:
    """(model key, benchmark, subject, request id) from the path below ``root``."""
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts
    subject = parts[-2] if len(parts) >= 2 else root.name
    bench = parts[-3] if len(parts) >= 3 else (root.parent.name if len(parts) == 2 else root.parent.name)
    model = "/".join(parts[:-3]) if len(parts) >= 4 else ""
    return model, bench, subject, rel.as_posix()


def _is_eval(request_id: str, seed: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}\0{request_id}".encode(), digest_size=8).digest(), "big")
    return h / 2.0 ** 64 < fraction


def import_trace(root, out, *, num_experts: int | None = None, top_k: int | None = None, seed: int = 0,
                 eval_fraction: float = 0.2, workers: int = 1, chunk_files: int = CHUNK_FILES,
                 progress: bool = True, log=None) -> ImportResult:
    from eldr_cli.capture.staging import Staging
    from eldr_cli.pipeline.capture import _progress

    log = log or (lambda m: None)
    root, out = Path(root), Path(out)
    files = _check_inputs(root, out, eval_fraction)
    staging = Staging(out, {"import": str(root.resolve())})
    staging.start_fresh()
    t0 = time.perf_counter()
    pool = None
    try:
        if workers > 1:
            import multiprocessing as mp

            pool = mp.get_context("spawn").Pool(workers)
            results: Iterator[tuple] = pool.imap(_parse_safe, (str(p) for p in files), chunksize=32)
        else:
            results = (_parse_safe(str(p)) for p in files)
        acc = _Accumulator(root, top_k, seed, eval_fraction, log)
        buf: list = []
        chunk = 0
        with _progress(progress) as bar:
            task = bar.add_task("import", total=None, reqs=0, toks=0, busy_s=0.0)
            for path, parsed, err in results:
                row = acc.add(Path(path), parsed, err)
                if row is not None:
                    buf.append(row)
                if len(buf) >= chunk_files:
                    _flush(staging, chunk, buf)
                    chunk, buf = chunk + 1, []
                bar.update(task, advance=1, reqs=acc.n_files, toks=0, busy_s=time.perf_counter() - t0)
            if buf:
                _flush(staging, chunk, buf)
        return _assemble(staging, root, out, acc, num_experts, top_k, seed, eval_fraction,
                         wall=time.perf_counter() - t0)
    except BaseException:
        staging.remove()
        raise
    finally:
        if pool is not None:
            pool.terminate()


def _check_inputs(root: Path, out: Path, eval_fraction: float) -> Iterator[Path]:
    """Refuse bad arguments before any work; -> the trace files (at least one)."""
    from eldr_cli.artifacts.store import MANIFEST

    if not root.is_dir():
        raise EldrError(f"--from-trace {root} is not a directory",
                        hint="point it at <org>/<model> (or below) of an Orders-in-Chaos trace tree")
    if not 0 <= eval_fraction < 1:
        raise EldrError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise EldrError(f"{out} exists and is not an eldr artifact; refusing to replace it")
    files = iter_trace_files(root)
    first = next(files, None)
    if first is None:
        raise EldrError(f"no *.json trace files below {root}")
    return itertools.chain([first], files)


class _Accumulator:
    """Checks each parsed file against the ones before it (one model, same MoE layers and k) and
    turns it into a staging row; counts and names the files that could not be parsed."""

    def __init__(self, root: Path, top_k: int | None, seed: int, eval_fraction: float, log):
        self.root, self.top_k, self.seed, self.eval_fraction, self.log = root, top_k, seed, eval_fraction, log
        self.layer_ids: tuple | None = None
        self.model_key: str | None = None
        self.k_seen: int | None = None
        self.E_max = 0
        self.n_files = self.n_bad = 0
        self.bad_examples: list[str] = []

    def add(self, p: Path, parsed, err: str | None):
        self.n_files += 1
        if err is not None:
            self.n_bad += 1
            if len(self.bad_examples) < 5:
                self.bad_examples.append(f"{p}: {err}")
            self.log(f"[yellow]warning:[/] skipping {p}: {err}")
            return None
        layers, prefill, picks, T, E = parsed
        mk, bench, subject, rid = _labels(self.root, p)
        if self.model_key is None:
            self.model_key = mk
        elif mk != self.model_key:
            raise EldrError(f"{self.root} holds traces of several models ({self.model_key!r} and {mk!r})",
                            hint="point --from-trace at one model's directory (<org>/<model>)")
        if self.layer_ids is None:
            self.layer_ids = layers
            self.k_seen = picks.shape[2] if picks.size else self.top_k
        elif layers != self.layer_ids:
            raise EldrError(f"{p}: MoE layers {list(layers)[:6]}... differ from the first file's "
                            f"{list(self.layer_ids)[:6]}...: files of different models mixed?")
        k_file = picks.shape[2]
        if self.k_seen is None:
            self.k_seen = k_file
        if k_file != self.k_seen:
            raise EldrError(f"{p}: {k_file} experts per token, other files have {self.k_seen}")
        self.E_max = max(self.E_max, E)
        split = "evaluation" if _is_eval(rid, self.seed, self.eval_fraction) else "calibration"
        return (prefill, picks, T, {"request_id": rid, "domain": subject, "language": "und", "prompt_tokens": T,
                                    "decode_tokens": picks.shape[0], "source": bench, "split": split, "prompt": ""})


def _assemble(staging, root: Path, out: Path, acc: _Accumulator, num_experts: int | None, top_k: int | None,
              seed: int, eval_fraction: float, wall: float) -> ImportResult:
    """The staged chunks -> the trace artifact, with the model facts the files agreed on."""
    from eldr_cli.capture.assemble import assemble_trace

    if acc.layer_ids is None:
        raise EldrError(f"none of the {acc.n_files} trace files below {root} could be read",
                        hint="; ".join(acc.bad_examples[:3]))
    k = top_k or acc.k_seen
    if top_k is not None and acc.k_seen is not None and top_k != acc.k_seen:
        raise EldrError(f"--top-k {top_k} disagrees with the traces ({acc.k_seen} experts per token)")
    E_max = acc.E_max
    if num_experts is not None:
        if num_experts < E_max:
            raise EldrError(f"--num-experts {num_experts} is smaller than the largest expert id + 1 ({E_max})")
        E_max = num_experts
    model = {"model": acc.model_key or root.name, "family": "imported", "num_layers": len(acc.layer_ids),
             "num_experts": E_max, "top_k": k, "moe_layer_ids": list(acc.layer_ids)}
    params = {"source_format": "orders-in-chaos", "from_trace": str(root), "seed": seed,
              "eval_fraction": eval_fraction, "num_experts_inferred": num_experts is None,
              "split_method": "seeded hash of request id"}
    metrics = {"n_files": acc.n_files, "n_skipped_files": acc.n_bad, "import_wall_s": round(wall, 3),
               "files_per_s": round(acc.n_files / wall, 1) if wall > 0 else None}
    written = assemble_trace(staging, out, model=model, params=params,
                             inputs={"source_tree": root} if acc.n_files <= 2000 else None, metrics=metrics)
    return ImportResult(out, written)


def _flush(staging, chunk: int, buf: list) -> None:
    E = max(b[0].shape[1] for b in buf)
    L = buf[0][0].shape[0]
    pre = np.zeros((len(buf), L, E), dtype=np.int32)
    dec = np.zeros((len(buf), L, E), dtype=np.int32)
    for i, (prefill, picks, _T, _row) in enumerate(buf):
        pre[i, :, :prefill.shape[1]] = prefill
        if picks.size:
            flat = picks.astype(np.int64) + (np.arange(L) * E)[None, :, None]
            dec[i] = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)
    k = buf[0][1].shape[2]
    arrays = {"prefill_counts": pre, "decode_counts": dec,
              "decode_steps": np.array([b[1].shape[0] for b in buf], dtype=np.int32),
              "prompt_tokens": np.array([b[2] for b in buf], dtype=np.int32),
              "decode_picks": np.concatenate([b[1] for b in buf]) if buf else np.zeros((0, L, k), np.int16)}
    staging.write_chunk(chunk, arrays, [b[3] for b in buf], [], {})
