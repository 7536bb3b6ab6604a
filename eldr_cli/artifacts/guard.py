"""Guards around artifacts: where one may be written, and whether one read is intact.

``check_output`` refuses output locations whose replacement would destroy something the user
owns; ``verify_on_read`` refuses an artifact whose files no longer match its manifest.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from eldr_cli.errors import EldrError

MANIFEST = "manifest.json"


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


# -- where an artifact may be written ------------------------------------------------------

# Output directories the caller explicitly allowed to be replaced by an artifact of another
# kind (the CLI's --force). A context variable, so pipeline functions need no extra parameter.
_REPLACE_OK: contextvars.ContextVar[frozenset[Path]] = contextvars.ContextVar("eldr_replace_ok", default=frozenset())


@contextlib.contextmanager
def replacing(*paths: str | os.PathLike | None, allow: bool = True) -> Iterator[None]:
    """Within this block, ``paths`` may be replaced even if they hold an artifact of another kind."""
    extra = frozenset(Path(p).resolve() for p in paths if p is not None and str(p)) if allow else frozenset()
    token = _REPLACE_OK.set(_REPLACE_OK.get() | extra)
    try:
        yield
    finally:
        _REPLACE_OK.reset(token)


def _kind_of(path: Path) -> str | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m.get("kind") if isinstance(m, dict) and m.get("tool") == "eldr" else None


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output(out: str | os.PathLike, kind: str, inputs: Iterable[str | os.PathLike] = (), *,
                 force: bool | None = None) -> Path:
    """Refuse an output location whose replacement would destroy something the user owns.

    Allowed: a new path, an empty directory, an artifact of the same ``kind`` (replaced
    atomically). Refused: an empty path or the current directory, a regular file, a
    non-artifact directory with content, any input of the command (or a folder holding one,
    or a folder inside one), and an artifact of another kind unless ``force`` (or
    :func:`replacing`) allows it.
    """
    raw = str(out)
    if raw.strip() in ("", "."):
        raise EldrError("the output path is empty or the current directory", hint="pass --out DIR, a new directory")
    p = Path(out)
    rp = p.resolve()
    if rp == Path.cwd().resolve() or rp == Path(rp.anchor):
        raise EldrError(f"refusing to write an artifact over {p} (the current or root directory)",
                        hint="pass --out DIR, a new directory")
    for i in inputs:
        ri = Path(i).resolve()
        if _overlaps(rp, ri):
            what = "is" if rp == ri else ("holds" if rp in ri.parents else "is inside")
            raise EldrError(f"output {p} {what} the input {i}; refusing to overwrite an input",
                            hint="choose another --out")
    if p.is_symlink() and not p.exists():
        raise EldrError(f"output {p} is a broken symbolic link", hint="remove it or choose another --out")
    if p.exists() and not p.is_dir():
        raise EldrError(f"output {p} is an existing file, not an artifact directory; refusing to replace it",
                        hint="choose another --out")
    if p.is_dir():
        have = _kind_of(p)
        if have is None:
            try:
                empty = not any(p.iterdir())
            except OSError as e:
                raise EldrError(f"cannot read output directory {p}: {e.strerror}") from None
            if not empty:
                raise EldrError(f"{p} exists and is not an eldr artifact; refusing to replace it",
                                hint="choose an empty or new --out directory")
        elif have != kind:
            allowed = force if force is not None else rp in _REPLACE_OK.get()
            if not allowed:
                raise EldrError(f"{p} holds a {have!r} artifact and this command writes a {kind!r} artifact; "
                                f"refusing to replace it", hint="choose another --out, or pass --force to replace it")
    return p


def _os_error(out: Path, e: OSError) -> EldrError:
    why = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
           errno.ENOSPC: "no space left on device", errno.ENOTDIR: "a parent is not a directory",
           errno.EEXIST: "a file is in the way"}.get(e.errno or -1, e.strerror or str(e))
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
    return EldrError(f"cannot write {out}: {why}{where}", hint="choose another --out")


# (resolved path, manifest mtime_ns, manifest size) of artifacts this process already verified
_VERIFIED: set[tuple[str, int, int]] = set()


def verify_on_read(art) -> None:
    """Refuse an artifact whose data files differ from its manifest (missing, other size, other sha256).

    Cheap enough to do on every read: sizes first (a stat per file), then one streaming sha256
    per data file (figures are views and only checked for presence); each artifact is verified
    once per process. Files the manifest does not name are ignored here (``eldr inspect`` lists them).
    """
    mf = art.path / MANIFEST
    st = mf.stat()
    key = (str(art.path.resolve()), st.st_mtime_ns, st.st_size)
    if key in _VERIFIED:
        return
    hint = f"run `eldr inspect {art.path}` to see every difference; rebuild the artifact with the stage that wrote it"
    for name, digest in sorted(art.manifest.get("files", {}).items()):
        f = art.path / name
        if not f.is_file():
            raise EldrError(f"{art.kind} artifact {art.path} is damaged: file {name} is missing", hint=hint)
        if name.endswith(".png"):
            continue
        try:
            ok = sha256_file(f) == digest
        except OSError as e:
            raise EldrError(f"cannot read {f}: {e.strerror}") from None
        if not ok:
            raise EldrError(f"{art.kind} artifact {art.path} is damaged: {name} does not match its manifest "
                            f"(changed after it was written)", hint=hint)
    _VERIFIED.add(key)
