"""Chunked, resumable capture output.

A running capture writes flushed chunks into a staging directory next to the output,
``.<out>.partial/``: ``chunk-000007.arrays/`` (the chunk's arrays, one ``.npy`` each) +
``chunk-000007.parquet`` (its request rows), each written to a temporary name and renamed, then
``state.json`` (rewritten atomically) lists the finished chunks. A killed capture therefore leaves
only whole chunks; ``--resume`` checks the fingerprint (model, prompt selection, capture parameters)
and continues at the first unfinished chunk. When all chunks are done they are streamed, chunk by
chunk, into the trace artifact (Zarr arrays written a whole chunk at a time) through
``ArtifactWriter``, which renames it into place atomically, and the staging directory is removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError

STATE = "state.json"


def staging_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_chunk_arrays(staging: Path, chunk: int, arrays: dict[str, np.ndarray]) -> None:
    """A chunk's arrays, one ``.npy`` file each in the folder ``chunk-N.arrays``, written under a
    temporary name and renamed. They are memory-mapped when read: an ``.npz`` cost a checksum pass
    and a copy, 0.3 s per 100 MB. numpy only, so a forked parser process may call it (polars' thread
    pool does not survive a fork)."""
    final = Path(staging) / f"chunk-{chunk:06d}.arrays"
    tmp = final.with_name(final.name + ".tmp")
    for stale in (tmp, final):  # left by a run killed before it recorded this chunk as done
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir()
    for name, a in arrays.items():
        np.save(tmp / f"{name}.npy", a)
    os.replace(tmp, final)


class ChunkArrays:
    """The arrays of one staged chunk by name (``.files`` lists them), memory-mapped read-only. Reads
    the ``chunk-N.npz`` of a staging directory written before 0.2 too (``--resume`` after an upgrade)."""

    def __init__(self, staging: Path, chunk: int):
        self.folder = Path(staging) / f"chunk-{chunk:06d}.arrays"
        self._npz = None
        if self.folder.is_dir():
            self.files = sorted(p.stem for p in self.folder.glob("*.npy"))
        else:
            self._npz = np.load(Path(staging) / f"chunk-{chunk:06d}.npz")
            self.files = list(self._npz.files)

    def __getitem__(self, name: str) -> np.ndarray:
        if self._npz is not None:
            return self._npz[name]
        return np.load(self.folder / f"{name}.npy", mmap_mode="r")


def write_chunk_table(staging: Path, chunk: int, rows) -> None:
    """A chunk's request rows (``chunk-N.parquet``), written under a temporary name and renamed."""
    import polars as pl

    df = pl.DataFrame(rows, schema={"request_id": pl.Utf8, "domain": pl.Utf8, "language": pl.Utf8,
                                    "prompt_tokens": pl.Int32, "decode_tokens": pl.Int32,
                                    "source": pl.Utf8, "split": pl.Utf8, "prompt": pl.Utf8})
    path = Path(staging) / f"chunk-{chunk:06d}.parquet"
    _atomic_write_bytes(path, lambda p: df.write_parquet(p))


class Staging:
    def __init__(self, out: Path, fingerprint: dict):
        self.out = Path(out)
        self.dir = staging_dir(self.out)
        self.fingerprint = fingerprint
        self.state: dict = {"fingerprint": fingerprint, "chunks": {}, "skipped": []}

    # -- lifecycle ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return (self.dir / STATE).is_file()

    def load(self) -> None:
        try:
            st = json.loads((self.dir / STATE).read_text())
        except (json.JSONDecodeError, OSError) as e:
            raise EldrError(f"cannot resume: {self.dir / STATE} is unreadable ({e})",
                            hint="rerun without --resume to start over") from None
        old = st.get("fingerprint", {})
        diff = [k for k in sorted(set(old) | set(self.fingerprint)) if old.get(k) != self.fingerprint.get(k)]
        if diff:
            what = "model" if any(k.startswith("model") for k in diff) else ", ".join(diff)
            raise EldrError(f"cannot resume {self.out}: the interrupted capture used a different {what} "
                            f"(differs in: {', '.join(diff)})",
                            hint="rerun with the same --model/--prompts/options, or without --resume to start over")
        self.state = st

    def start_fresh(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self._write_state()

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _write_state(self) -> None:
        _atomic_write_bytes(self.dir / STATE, lambda p: p.write_text(json.dumps(self.state, indent=1)))

    # -- chunks ------------------------------------------------------------------------------
    def done(self, chunk: int) -> bool:
        return str(chunk) in self.state["chunks"]

    def n_done_requests(self) -> int:
        return sum(c["n"] for c in self.state["chunks"].values())

    def write_chunk(self, chunk: int, arrays: dict[str, np.ndarray], rows, skipped: list[dict],
                    stats: dict) -> None:
        write_chunk_arrays(self.dir, chunk, arrays)
        write_chunk_table(self.dir, chunk, rows)
        self.chunk_done(chunk, len(rows), skipped, stats)

    def chunk_done(self, chunk: int, n_rows: int, skipped: list[dict], stats: dict) -> None:
        """Record a chunk whose arrays and table are written (the arrays maybe by another process)."""
        self.state["chunks"][str(chunk)] = {"n": n_rows, **stats}
        self.state["skipped"].extend(skipped)
        self._write_state()

    def write_empty_chunk(self, chunk: int, skipped: list[dict]) -> None:
        """Mark a chunk whose prompts were all skipped as done (no arrays, no table)."""
        self.state["chunks"][str(chunk)] = {"n": 0}
        self.state["skipped"].extend(skipped)
        self._write_state()

    def chunk_ids(self) -> list[int]:
        return sorted(int(c) for c in self.state["chunks"])

    def chunk_arrays(self, chunk: int) -> ChunkArrays:
        return ChunkArrays(self.dir, chunk)

    def chunk_table(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.parquet"
