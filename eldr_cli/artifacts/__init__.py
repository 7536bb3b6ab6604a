"""Versioned Zarr/Parquet artifacts with manifests (see store.py) and the trace artifact."""

from eldr_cli.artifacts.store import (  # noqa: F401
    SCHEMA_VERSIONS,
    Artifact,
    ArtifactWriter,
    input_hash,
    read_manifest,
    validate_manifest,
)
