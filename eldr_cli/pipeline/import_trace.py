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
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

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
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            if (p := skip(d, f"unreadable folder ({e.strerror})")) is not None:
                yield p
            continue
        dirs = []
        for e in entries:
            try:
                is_dir = e.is_dir()  # follows symbolic links
                is_file = not is_dir and e.is_file()
            except OSError:
                is_dir = is_file = False
            if is_dir:
                dirs.append(Path(e.path))
            elif e.name.endswith(".json"):
                if is_file:
                    yield Path(e.path)
                elif (p := skip(Path(e.path), "broken symbolic link or not a file")) is not None:
                    yield p
        stack.extend(reversed(dirs))


_ALLOWED = np.zeros(256, dtype=bool)
for _c in b"0123456789[]{},: \t\r\nnul\"":
    _ALLOWED[_c] = True
_WS = np.zeros(256, dtype=bool)
for _c in b" \t\r\n":
    _WS[_c] = True
_QUOTE, _COMMA, _COLON, _LSQ, _RSQ, _LBR, _RBR = b'",:[]{}'


def _numbers(b: np.ndarray):
    """(end position, value) of every integer of at most 3 digits in the byte array ``b``, or None
    if there are longer numbers or numbers with leading zeros (the JSON path decides then).

    Expert and layer ids are below 1000, so a number's value is read from its last three bytes at
    once: a few passes over the bytes and the rest per number, several times cheaper than
    locating every digit run.
    """
    d = b - np.uint8(48)  # digits -> 0..9, everything else wraps to >= 10
    isd = d < 10
    ends = np.flatnonzero(isd[:-1] & ~isd[1:])
    if ends.size == 0:
        return None
    # ends >= 1 since b[0] is '['; negative indices below reach the last bytes, which are not digits
    d1 = isd[ends - 1]
    d2 = d1 & isd[ends - 2]
    if (d2 & isd[ends - 3]).any():
        return None
    first = ends - d1 - d2
    if ((d1 | d2) & (d[first] == 0)).any():
        return None  # leading zero: not JSON
    vals = d[ends].astype(np.int64)
    vals += 10 * d[ends - 1] * d1
    vals += 100 * d[ends - 2].astype(np.int64) * d2
    return ends, first, vals


def _next_byte(b: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The first non-whitespace byte after each position (compact or ", "-separated files need no search)."""
    nxt = b[pos + 1]
    if _WS[nxt].any():
        solid = np.flatnonzero(~_WS[b])
        nxt = b[solid[np.searchsorted(solid, pos, side="right")]]
    return nxt


def _fast_parse(raw: bytes):
    """Vectorised parse of the common case (small integers, brackets, quoted integer keys, null); None
    if the file uses anything else, then the JSON parser decides. Same result as the JSON path."""
    raw = raw.strip(b" \t\r\n")  # the whitespace JSON allows around the document
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size < 2 or b[0] != _LSQ or b[-1] != _RSQ:
        return None
    hist = np.bincount(b, minlength=256)
    if hist[~_ALLOWED].any():
        return None
    n_null = raw.count(b"null")  # every n, u, l must belong to a "null"
    if not hist[ord("n")] == hist[ord("u")] == n_null or hist[ord("l")] != 2 * n_null:
        return None
    found = _numbers(b)
    if found is None:
        return None
    ends, first, vals = found
    nxt = _next_byte(b, ends)
    # strings may only be quoted integer keys: "<digits>"
    is_key = nxt == _QUOTE
    if int(hist[_QUOTE]) != 2 * int(is_key.sum()) or not (b[first[is_key] - 1] == _QUOTE).all():
        return None
    if int(hist[_COLON]) != int(is_key.sum()):
        return None
    brace_pos = np.flatnonzero(b == _LBR)
    n_elem = int(brace_pos.size)
    if n_elem == 0 or int(hist[_RBR]) != n_elem:
        return None
    val = ~is_key
    if not ((nxt[val] == _COMMA) | (nxt[val] == _RSQ)).all():
        return None
    elem = np.searchsorted(brace_pos, ends, side="right") - 1
    ridx = np.where(is_key, np.arange(ends.size), -1)
    last_key = np.maximum.accumulate(ridx)
    if (last_key[val] < 0).any():
        return None
    v_layer = vals[last_key[val]]
    v_elem = elem[val]
    v = vals[val]
    if v.size == 0:
        return None
    # every innermost list holds k ids: list ends (a ']' after the id) fall on k-1, 2k-1, ...
    last_in_list = np.flatnonzero(nxt[val] == _RSQ)
    k = int(last_in_list[0]) + 1
    if v.size % k or not np.array_equal(last_in_list, np.arange(k - 1, v.size, k)):
        return None
    n0 = int(np.searchsorted(v_elem, 1))  # values of element 0 come first
    layers = np.unique(v_layer[:n0])
    if layers.size == 0:
        return None
    L = layers.size
    if int(v_layer.max()) > int(layers[-1]):
        return None
    lut = np.full(int(layers[-1]) + 1, -1, dtype=np.int64)
    lut[layers] = np.arange(L)
    lrank = lut[v_layer]
    if (lrank < 0).any():
        return None  # a layer present in decode but not in prefill: let the JSON path explain
    cell = v_elem * L + lrank
    counts = np.bincount(cell, minlength=n_elem * L).reshape(n_elem, L)
    T, rem = divmod(int(counts[0, 0]), k)
    if rem or T == 0 or (counts[0] != T * k).any() or (n_elem > 1 and (counts[1:] != k).any()):
        return None
    # brackets: the outer list, per MoE layer a list of T token lists in prefill and of 1 per decode step
    n_lists = 1 + L * (T + 1) + (n_elem - 1) * L * 2
    if int(hist[_LSQ]) != n_lists or int(hist[_RSQ]) != n_lists:
        return None
    if (cell[1:] < cell[:-1]).any():
        # key order inside an element may differ from sorted order: stable sort by (element, layer)
        v = v[np.argsort(cell, kind="stable")]
    E = int(v.max()) + 1
    pre = v[:L * T * k].reshape(L, T * k)
    flat = pre + (np.arange(L) * E)[:, None]
    prefill = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E).astype(np.int32)
    picks = np.sort(v[L * T * k:].reshape(n_elem - 1, L, k), axis=-1).astype(np.int16)
    return tuple(int(x) for x in layers), prefill, picks, T, E


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
    from eldr_cli.artifacts.store import MANIFEST
    from eldr_cli.capture.assemble import assemble_trace
    from eldr_cli.capture.staging import Staging

    log = log or (lambda m: None)
    root = Path(root)
    out = Path(out)
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

    def all_files():
        yield first
        yield from files

    staging = Staging(out, {"import": str(root.resolve())})
    staging.start_fresh()
    t0 = time.perf_counter()
    pool = None
    try:
        if workers > 1:
            import multiprocessing as mp

            pool = mp.get_context("spawn").Pool(workers)
            results = pool.imap(_parse_safe, (str(p) for p in all_files()), chunksize=32)
        else:
            results = (_parse_safe(str(p)) for p in all_files())
        layer_ids = None
        model_key = None
        k_seen = None
        E_max = 0
        n_files = n_bad = 0
        bad_examples: list[str] = []
        buf: list = []
        chunk = 0
        from eldr_cli.pipeline.capture import _progress

        with _progress(progress) as bar:
            task = bar.add_task("import", total=None, reqs=0, toks=0, busy_s=0.0)
            for path, parsed, err in results:
                n_files += 1
                p = Path(path)
                if err is not None:
                    n_bad += 1
                    if len(bad_examples) < 5:
                        bad_examples.append(f"{p}: {err}")
                    log(f"[yellow]warning:[/] skipping {p}: {err}")
                    continue
                layers, prefill, picks, T, E = parsed
                mk, bench, subject, rid = _labels(root, p)
                if model_key is None:
                    model_key = mk
                elif mk != model_key:
                    raise EldrError(f"{root} holds traces of several models ({model_key!r} and {mk!r})",
                                    hint="point --from-trace at one model's directory (<org>/<model>)")
                if layer_ids is None:
                    layer_ids, k_seen = layers, picks.shape[2] if picks.size else None
                    if k_seen is None:
                        k_seen = top_k
                elif layers != layer_ids:
                    raise EldrError(f"{p}: MoE layers {list(layers)[:6]}... differ from the first file's "
                                    f"{list(layer_ids)[:6]}...: files of different models mixed?")
                k_file = picks.shape[2]
                if k_seen is None:
                    k_seen = k_file
                if k_file != k_seen:
                    raise EldrError(f"{p}: {k_file} experts per token, other files have {k_seen}")
                E_max = max(E_max, E)
                buf.append((prefill, picks, T, {"request_id": rid, "domain": subject, "language": "und",
                                                "prompt_tokens": T, "decode_tokens": picks.shape[0],
                                                "source": bench, "split": "evaluation"
                                                if _is_eval(rid, seed, eval_fraction) else "calibration",
                                                "prompt": ""}))
                if len(buf) >= chunk_files:
                    _flush(staging, chunk, buf)
                    chunk += 1
                    buf = []
                dt = time.perf_counter() - t0
                bar.update(task, advance=1, reqs=n_files, toks=0, busy_s=dt)
            if buf:
                _flush(staging, chunk, buf)
        if layer_ids is None:
            raise EldrError(f"none of the {n_files} trace files below {root} could be read",
                            hint="; ".join(bad_examples[:3]))
        k = top_k or k_seen
        if top_k is not None and k_seen is not None and top_k != k_seen:
            raise EldrError(f"--top-k {top_k} disagrees with the traces ({k_seen} experts per token)")
        if num_experts is not None:
            if num_experts < E_max:
                raise EldrError(f"--num-experts {num_experts} is smaller than the largest expert id + 1 ({E_max})")
            E_max = num_experts
        wall = time.perf_counter() - t0
        model = {"model": model_key or root.name, "family": "imported", "num_layers": len(layer_ids),
                 "num_experts": E_max, "top_k": k, "moe_layer_ids": list(layer_ids)}
        params = {"source_format": "orders-in-chaos", "from_trace": str(root), "seed": seed,
                  "eval_fraction": eval_fraction, "num_experts_inferred": num_experts is None,
                  "split_method": "seeded hash of request id"}
        metrics = {"n_files": n_files, "n_skipped_files": n_bad, "import_wall_s": round(wall, 3),
                   "files_per_s": round(n_files / wall, 1) if wall > 0 else None}
        written = assemble_trace(staging, out, model=model, params=params,
                                 inputs={"source_tree": root} if n_files <= 2000 else None, metrics=metrics)
        return ImportResult(out, written)
    except BaseException:
        staging.remove()
        raise
    finally:
        if pool is not None:
            pool.terminate()


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
