"""Versioned artifacts: a directory of Zarr arrays, Parquet tables and figures, plus manifest.json.

Every stage writes through :class:`ArtifactWriter`, which builds the artifact in a temporary
sibling directory and renames it into place only when the stage finished, so a failed or
interrupted stage never leaves a half artifact. The manifest records kind, schema version,
tool version, created time, parameters, the content hashes of the inputs and of the
artifact's own files, and the stage's headline metrics.

Layout of an artifact directory::

    manifest.json
    data.zarr/            Zarr v3 group, one array per name
    <table>.parquet       Polars/Parquet tables
    <figure>.png          figures (hashed, but not part of ``content_hash``)
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from eldr_cli import __version__
from eldr_cli.artifacts.guard import MANIFEST, _os_error, check_output, replacing, sha256_file, verify_on_read
from eldr_cli.artifacts.schema import MANIFESTS_DIR, SCHEMA_VERSIONS, read_manifest, schema_file, validate_manifest
from eldr_cli.errors import EldrError

ARRAYS = "data.zarr"
__all__ = ["Artifact", "ArtifactWriter", "MANIFEST", "MANIFESTS_DIR", "ARRAYS", "SCHEMA_VERSIONS", "check_output",
           "replacing", "sha256_file", "verify_on_read", "read_manifest", "schema_file", "validate_manifest",
           "input_hash"]

def _hash_tree(root: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file below ``root`` except the manifest, keyed by relative posix path.

    ``known`` maps relative paths to digests a caller already computed from the files' bytes (the
    trace import hashes each file as it parses it): those files are not read again. The walk and the
    keys are the same either way, so the result is too."""
    out: dict[str, str] = {}
    known = known or {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            out[rel] = known.get(rel) or sha256_file(p)
    return out


def _content_hash(files: dict[str, str]) -> str:
    """One hash over the data files (figures excluded: they are views, not content)."""
    h = hashlib.sha256()
    for name, digest in sorted(files.items()):
        if name.endswith(".png"):
            continue
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()


def input_hash(path: str | os.PathLike, known: dict[str, str] | None = None) -> str:
    """Content hash of an input: an artifact's ``content_hash``, a plain file's sha256 or a folder's
    tree hash (``known``: digests already computed for files below it, see :func:`_hash_tree`)."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return read_manifest(p)["content_hash"]
    if p.is_file():
        return sha256_file(p)
    if p.is_dir():
        return _content_hash(_hash_tree(p, known))
    raise EldrError(f"input {p} does not exist")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


class ArtifactWriter:
    """Builds one artifact atomically.

    >>> with ArtifactWriter("artifacts/idf", kind="idf", params={...}, inputs={"trace": t}) as w:
    ...     w.write_array("idf", idf)
    ...     w.metrics["n_requests"] = 1000
    """

    def __init__(self, out: str | os.PathLike, *, kind: str, params: dict | None = None,
                 inputs: dict[str, str | os.PathLike] | None = None, overwrite: bool = True,
                 input_digests: dict[str, dict[str, str]] | None = None):
        if kind not in SCHEMA_VERSIONS:
            raise ValueError(f"unknown artifact kind {kind!r}")
        self.out = Path(out)
        self.kind = kind
        self.params = dict(params or {})
        self.inputs = {k: str(v) for k, v in (inputs or {}).items()}
        self.metrics: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.overwrite = overwrite
        self.input_digests = input_digests or {}  # input name -> {relative path: sha256} already computed
        self._t0 = time.perf_counter()
        self._group: Any = None  # the zarr group, opened on first use
        self.tmp: Path | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "ArtifactWriter":
        if self.out.exists() and not self.overwrite:
            raise EldrError(f"{self.out} exists; pass --force or choose another --out")
        check_output(self.out, self.kind, self.inputs.values())
        self._input_hashes = {k: input_hash(v, self.input_digests.get(k)) for k, v in self.inputs.items()}
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.out.parent / f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
        except OSError as e:
            raise _os_error(self.out, e) from None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
                raise _os_error(self.out, exc) from None
            return
        try:
            self._finish()
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise _os_error(self.out, e) from None
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _finish(self) -> None:
        assert self.tmp is not None
        files = _hash_tree(self.tmp)
        manifest = {
            "kind": self.kind,
            "schema_version": SCHEMA_VERSIONS[self.kind],
            "tool": "eldr",
            "tool_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "params": _jsonable(self.params),
            "inputs": {k: {"path": v, "content_hash": self._input_hashes[k]} for k, v in self.inputs.items()},
            "files": files,
            "content_hash": _content_hash(files),
            "metrics": _jsonable({**self.metrics, "wall_time_s": round(time.perf_counter() - self._t0, 4)}),
            **_jsonable(self.extra),
        }
        validate_manifest(manifest)
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    # -- content -------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        assert self.tmp is not None, "use ArtifactWriter as a context manager"
        return self.tmp

    def _zgroup(self):
        if self._group is None:
            import zarr

            self._group = zarr.open_group(str(self.path / ARRAYS), mode="a", zarr_format=3)
        return self._group

    def write_array(self, name: str, data: np.ndarray, chunks: tuple[int, ...] | None = None) -> None:
        data = np.ascontiguousarray(data)
        g = self._zgroup()
        kw = {}
        if chunks is not None:
            kw["chunks"] = chunks
        arr = g.create_array(name, shape=data.shape, dtype=data.dtype, overwrite=True, **kw)
        if data.size:
            arr[...] = data

    def create_rows(self, name: str, n_rows: int, trailing_shape: tuple[int, ...], dtype,
                    chunk_rows: int = 256) -> "RowWriter":
        """An array of ``n_rows`` rows to fill in order, a batch at a time (:class:`RowWriter`)."""
        arr = self._zgroup().create_array(name, shape=(n_rows, *trailing_shape), dtype=dtype,
                                          chunks=(chunk_rows, *trailing_shape), overwrite=True)
        return RowWriter(arr, chunk_rows)

    def write_table(self, name: str, df) -> None:
        df.write_parquet(self.path / f"{name}.parquet", statistics=False)

    def write_json(self, name: str, obj: Any) -> None:
        (self.path / name).write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n")

    def figure_path(self, name: str) -> Path:
        return self.path / name


class RowWriter:
    """Fills a Zarr array of known length in row order. Batches of any size are held until they make
    whole chunks, so each chunk is compressed and written once: appending 256-row batches to
    1,024-row chunks rewrote every chunk four times (and resized the array each time)."""

    def __init__(self, arr, chunk_rows: int):
        self.arr, self.chunk_rows = arr, chunk_rows
        self.at = 0
        self.pending: list[np.ndarray] = []
        self.n_pending = 0

    def add(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=self.arr.dtype)
        if self.at + self.n_pending + len(rows) > self.arr.shape[0]:
            raise ValueError(f"{self.arr.name}: more rows than the {self.arr.shape[0]} declared")
        self.pending.append(rows)
        self.n_pending += len(rows)
        if self.n_pending >= self.chunk_rows:
            self._write(self.n_pending // self.chunk_rows * self.chunk_rows)

    def close(self) -> None:
        """Write what is held; every declared row must have been added."""
        if self.n_pending:
            self._write(self.n_pending)
        if self.at != self.arr.shape[0]:
            raise ValueError(f"{self.arr.name}: {self.at} rows written of the {self.arr.shape[0]} declared")

    def _write(self, n: int) -> None:
        buf = self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)
        self.arr[self.at:self.at + n] = buf[:n]
        self.at += n
        self.pending = [buf[n:]] if n < len(buf) else []
        self.n_pending = len(buf) - n


# -- reading (manifests and their schemas: eldr_cli.artifacts.schema) ------------------------

class Artifact:
    """A read-only view of an artifact directory; its files are verified against the manifest on open."""

    def __init__(self, path: str | os.PathLike, kind: str | Iterable[str] | None = None, validate: bool = True,
                 verify: bool = True):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if kind is not None:
            kinds = {kind} if isinstance(kind, str) else set(kind)
            if self.manifest["kind"] not in kinds:
                raise EldrError(
                    f"{self.path} is a {self.manifest['kind']!r} artifact; expected {' or '.join(sorted(kinds))}")
        if validate:
            validate_manifest(self.manifest)
        if verify:
            verify_on_read(self)
        self._group: Any = None  # the zarr group, opened on first use

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def params(self) -> dict:
        return self.manifest.get("params", {})

    @property
    def metrics(self) -> dict:
        return self.manifest.get("metrics", {})

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    def _zgroup(self):
        if self._group is None:
            import zarr

            zpath = self.path / ARRAYS
            if not zpath.exists():
                raise EldrError(f"{self.path} has no arrays ({ARRAYS} missing): a damaged artifact")
            self._group = zarr.open_group(str(zpath), mode="r", zarr_format=3)
        return self._group

    def has_array(self, name: str) -> bool:
        return (self.path / ARRAYS / name).exists()

    def array(self, name: str, *, lazy: bool = False):
        if not self.has_array(name):
            raise EldrError(f"{self.kind} artifact {self.path} lacks array {name!r}")
        try:
            arr = self._zgroup()[name]
            return arr if lazy else arr[...]
        except EldrError:
            raise
        except Exception as e:  # zstd/codec/JSON errors from a damaged chunk or array metadata
            raise EldrError(f"cannot read array {name!r} of {self.path / ARRAYS / name}: {type(e).__name__}: {e}",
                            hint=f"the artifact is damaged; check it with `eldr inspect {self.path}`") from None

    def arrays(self, names: list[str]) -> dict[str, np.ndarray]:
        """Several arrays, read at the same time in threads (Zstd decompression releases the GIL:
        the four [1,250, 48, 128] arrays of a trace take ~0.12 s instead of ~0.2 s one after another)."""
        from concurrent.futures import ThreadPoolExecutor

        self._zgroup()  # opened once, before the threads
        with ThreadPoolExecutor(min(4, max(1, len(names))), thread_name_prefix="eldr-read") as ex:
            return dict(zip(names, ex.map(self.array, names), strict=True))

    def table(self, name: str):
        import polars as pl

        f = self.path / f"{name}.parquet"
        if not f.is_file():
            raise EldrError(f"{self.kind} artifact {self.path} lacks table {name!r}")
        try:
            return pl.read_parquet(f)
        except Exception as e:  # truncated or foreign Parquet
            raise EldrError(f"cannot read table {f}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                            hint=f"the artifact is damaged; check it with `eldr inspect {self.path}`") from None

    def verify(self) -> list[str]:
        """Re-hash the files; return a list of problems (empty when intact)."""
        problems = []
        actual = _hash_tree(self.path)
        expected = self.manifest.get("files", {})
        for name, digest in expected.items():
            if name not in actual:
                problems.append(f"missing file {name}")
            elif actual[name] != digest:
                problems.append(f"content of {name} changed")
        for name in actual.keys() - expected.keys():
            problems.append(f"unexpected file {name}")
        return problems
