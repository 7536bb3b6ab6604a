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

import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eldr_cli.capture.import_file import (  # noqa: F401  (parse_trace_file: the public per-file parser)
    BadTraceFile,
    _Job,
    _rel,
    parse_trace_file,
    stage_batch,
    warm_up,
)
from eldr_cli.errors import EldrError

if TYPE_CHECKING:
    from eldr_cli.capture.figures import Aggregates

CHUNK_FILES = 256
HASH_FILES_MAX = 2000  # source trees up to this many files get an input hash in the manifest


@dataclass
class ImportResult:
    out: Path
    metrics: dict


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


def import_trace(root, out, *, num_experts: int | None = None, top_k: int | None = None, seed: int = 0,
                 eval_fraction: float = 0.2, workers: int = 1, chunk_files: int = CHUNK_FILES,
                 progress: bool = True, log=None) -> ImportResult:
    from eldr_cli.capture.progress import progress_bar
    from eldr_cli.capture.staging import Staging, write_chunk_table

    log = log or (lambda m: None)
    root, out = Path(root), Path(out)
    files = _check_inputs(root, out, eval_fraction)
    staging = Staging(out, {"import": str(root.resolve())})
    staging.start_fresh()
    t0 = time.perf_counter()
    pool: Any = None
    preload: threading.Thread | None = None
    job = _Job(root, seed, eval_fraction)
    tasks = ((str(p), i < HASH_FILES_MAX) for i, p in enumerate(files))
    batches = enumerate(_batched(tasks, chunk_files))  # one staging chunk per batch
    stage = partial(stage_batch, job, str(staging.dir))
    try:
        if workers > 1:
            pool = _start_pool(workers)
        preload = _preload()  # matplotlib and the artifact writers' imports, while the files are parsed
        results: Iterator[tuple] = pool.imap(stage, batches) if pool is not None else map(stage, batches)
        acc = _Accumulator(root, log)
        with progress_bar(progress) as bar:
            task = bar.add_task("import", total=None, reqs=0, toks=0, busy_s=0.0)
            for chunk, files_done, rows, chunk_agg in results:
                for path, err, digest, facts in files_done:
                    if digest is not None:
                        acc.digests[path] = digest
                    acc.add(path, facts, err)
                if chunk is not None:  # every file of it parsed and agreed: one row each
                    write_chunk_table(staging.dir, chunk, rows)
                    staging.chunk_done(chunk, len(rows), [], {})
                    acc.aggregates = chunk_agg if acc.aggregates is None else acc.aggregates.merge(chunk_agg)
                if progress:
                    bar.update(task, completed=acc.n_files, reqs=acc.n_files, toks=0,
                               busy_s=time.perf_counter() - t0)
        if pool is not None:  # its workers and threads are gone before the figures' processes fork (~5 ms)
            pool.close()
            pool.join()
        preload.join()  # idem
        return _assemble(staging, root, out, acc, num_experts, top_k, seed, eval_fraction,
                         wall=time.perf_counter() - t0, draw_in_background=workers > 1)
    except BaseException:
        if pool is not None:  # its workers stop before the staging area goes: a late batch would write it again
            pool.terminate()
            pool.join()
        staging.remove()
        raise
    finally:
        if pool is not None:
            pool.terminate()
        if preload is not None:
            preload.join()  # never leave an import running in a daemon thread at exit


def _batched(items, n: int):
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def _start_pool(workers: int):
    """The parser processes. On Linux they are forked from this process once it has loaded the compiled
    parser (from numba's cache, or compiled once), so each starts in milliseconds instead of importing
    numba and loading the parser again (~1 s CPU each); no other thread runs yet. Elsewhere: spawned."""
    import multiprocessing as mp
    import sys

    if sys.platform.startswith("linux"):
        warm_up()
        return mp.get_context("fork").Pool(workers)
    return mp.get_context("spawn").Pool(workers)


def _preload():
    """Import what assembling the artifact needs (matplotlib ~0.5 s, zarr ~0.25 s) in a thread while the
    files are parsed: the parser processes, or the compiled scan (it releases the GIL), leave the main
    interpreter idle most of the time. -> the started thread (join it before leaving)."""

    def work():
        import jsonschema  # noqa: F401  (the manifest's validation)
        import zarr  # noqa: F401

        from eldr_cli import plots
        from eldr_cli.capture import assemble  # noqa: F401  (polars, the figures module)

        plots.plt()

    thread = threading.Thread(target=work, name="eldr-preload-import", daemon=True)
    thread.start()
    return thread


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
    """Checks each parsed file against the ones before it (one model, same MoE layers and k); counts
    and names the files that could not be parsed; holds what the manifest needs of all of them."""

    def __init__(self, root: Path, log):
        self.root, self.log = root, log
        self.layer_ids: tuple | None = None
        self.model_key: str | None = None
        self.k_seen: int | None = None
        self.E_max = 0
        self.n_files = self.n_bad = 0
        self.bad_examples: list[str] = []
        self.digests: dict[str, str] = {}  # path -> sha256 of the bytes parsed (first HASH_FILES_MAX files)
        self.aggregates: Aggregates | None = None  # the figures' sums over the staged chunks

    def add(self, p: str, facts, err: str | None) -> None:
        """One file in order: facts = (layer ids, k, E', model key), or None with ``err`` (the file is
        skipped); raises if it disagrees with the files before."""
        self.n_files += 1
        if err is not None:
            self.n_bad += 1
            if len(self.bad_examples) < 5:
                self.bad_examples.append(f"{p}: {err}")
            self.log(f"[yellow]warning:[/] skipping {p}: {err}")
            return
        layers, k_file, E, mk = facts
        if self.model_key is None:
            self.model_key = mk
        elif mk != self.model_key:
            raise EldrError(f"{self.root} holds traces of several models ({self.model_key!r} and {mk!r})",
                            hint="point --from-trace at one model's directory (<org>/<model>)")
        if self.layer_ids is None:
            self.layer_ids = layers
            self.k_seen = k_file
        elif layers != self.layer_ids:
            raise EldrError(f"{p}: MoE layers {list(layers)[:6]}... differ from the first file's "
                            f"{list(self.layer_ids)[:6]}...: files of different models mixed?")
        if k_file != self.k_seen:
            raise EldrError(f"{p}: {k_file} experts per token, other files have {self.k_seen}")
        self.E_max = max(self.E_max, E)

    def source_digests(self) -> dict[str, str] | None:
        """The digests keyed by path relative to the root (as the input hash names them)."""
        root = str(self.root)
        rel = {r: d for p, d in self.digests.items() if (r := _rel(root, p))}
        return rel


def _assemble(staging, root: Path, out: Path, acc: _Accumulator, num_experts: int | None, top_k: int | None,
              seed: int, eval_fraction: float, wall: float, draw_in_background: bool) -> ImportResult:
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
    small = acc.n_files <= HASH_FILES_MAX  # larger trees are not hashed (minutes of reading for a record)
    written = assemble_trace(staging, out, model=model, params=params,
                             inputs={"source_tree": root} if small else None, metrics=metrics,
                             input_digests={"source_tree": acc.source_digests() or {}} if small else None,
                             aggregates=acc.aggregates, draw_in_background=draw_in_background)
    return ImportResult(out, written)
