"""Manifests: reading one, and checking it against the JSON Schema of its kind and version.

The schemas ship inside the package (``eldr_cli/schemas``; in the repository a link to ``manifests/``).
:mod:`eldr_cli.artifacts.store` re-exports these names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eldr_cli.artifacts.guard import MANIFEST
from eldr_cli.errors import EldrError

# Newest schema version of each artifact kind this tool reads and writes.
SCHEMA_VERSIONS: dict[str, int] = {
    "trace": 1,
    "idf": 1,
    "layers": 1,
    "routing": 1,
    "fit": 1,
    "placement": 1,
    "placement-eval": 1,
    "cost-model": 1,
    "bench": 1,
    "replay": 1,
}

MANIFESTS_DIR = Path(__file__).resolve().parents[1] / "schemas"


def read_manifest(path: str | os.PathLike) -> dict:
    p = Path(path)
    mf = p / MANIFEST
    if not p.exists():
        raise EldrError(f"{p} does not exist", hint="run the stage that writes it first (see `eldr --help`)")
    if not mf.is_file():
        raise EldrError(f"{p} is not an eldr artifact (no {MANIFEST})")
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EldrError(f"{mf} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("tool") != "eldr" or "kind" not in m:
        raise EldrError(f"{mf} is not an eldr manifest (expected tool=eldr and a kind)")
    return m


_schema_cache: dict[str, dict] = {}


def load_schema(name: str) -> dict:
    """A JSON Schema shipped in ``manifests/`` by file name (read once)."""
    if name not in _schema_cache:
        f = MANIFESTS_DIR / name
        if not f.is_file():
            raise EldrError(f"JSON Schema {f} is missing from the installation")
        _schema_cache[name] = json.loads(f.read_text())
    return _schema_cache[name]


def schema_file(kind: str, version: int | None = None) -> str:
    return f"{kind}.v{version or SCHEMA_VERSIONS[kind]}.schema.json"


def validate_manifest(m: dict) -> None:
    """Check a manifest against the JSON Schema of its kind and version (manifests/)."""
    import jsonschema
    from referencing import Registry, Resource

    kind = m.get("kind")
    if kind not in SCHEMA_VERSIONS:
        raise EldrError(f"unknown artifact kind {kind!r}; this eldr knows {sorted(SCHEMA_VERSIONS)}")
    version = m.get("schema_version")
    if not isinstance(version, int):
        raise EldrError(f"manifest has no integer schema_version (kind {kind})")
    if version > SCHEMA_VERSIONS[kind]:
        raise EldrError(
            f"{kind} artifact has schema version {version}, newer than this eldr supports "
            f"({SCHEMA_VERSIONS[kind]})", hint="upgrade eldr or rebuild the artifact with this version")
    base = load_schema("manifest.schema.json")
    registry = Registry().with_resource("manifest.schema.json", Resource.from_contents(base))
    schema = load_schema(schema_file(kind, version))
    v = jsonschema.Draft202012Validator(schema, registry=registry)
    errors = sorted(v.iter_errors(m), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = "/".join(str(x) for x in e.path) or "(top level)"
        raise EldrError(f"{kind} manifest does not match {schema_file(kind, version)} at {where}: {e.message}")
