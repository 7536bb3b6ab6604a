"""Versioned artifacts: manifests, schema validation, atomic writes, reproducible hashes."""

import json

import numpy as np
import pytest

from eldr_cli.artifacts.store import Artifact, ArtifactWriter, validate_manifest
from eldr_cli.artifacts.trace import read_trace, write_trace
from eldr_cli.errors import EldrError
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.synth import synthetic_trace


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("art") / "trace"
    write_trace(d, synthetic_trace(120, 6, 16, 2, with_picks=True, decode_steps=12, seed=1))
    return d


def test_trace_roundtrip(small_trace):
    t = read_trace(small_trace)
    assert t.prefill_counts.shape == (120, 6, 16) and t.prefill_counts.dtype == np.int32
    assert t.decode_picks.shape == (120 * 12, 6, 2)
    assert t.decode_offsets[-1] == 120 * 12
    # per-step picks reproduce the decode counts
    r = 7
    steps = t.steps_of(r)
    counts = np.zeros((6, 16), dtype=int)
    for s in steps:
        for l in range(6):
            counts[l, s[l]] += 1
    np.testing.assert_array_equal(counts, t.decode_counts[r])
    m = Artifact(small_trace).manifest
    assert m["kind"] == "trace" and m["schema_version"] == 1 and m["params"]["top_k"] == 2
    assert Artifact(small_trace).verify() == []


def test_failed_stage_leaves_nothing(tmp_path):
    out = tmp_path / "x"
    with pytest.raises(RuntimeError):
        with ArtifactWriter(out, kind="idf", params={"transform": "count-idf"}) as w:
            w.write_array("idf", np.ones((2, 2)))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_old_artifact(tmp_path):
    out = tmp_path / "x"
    with ArtifactWriter(out, kind="idf", params={"transform": "count-idf"}) as w:
        w.write_array("idf", np.ones((2, 2)))
        w.write_array("df", np.ones((2, 2), dtype=np.int32))
        w.metrics["n_requests"] = 1
    before = Artifact(out).content_hash
    with pytest.raises(RuntimeError):
        with ArtifactWriter(out, kind="idf", params={"transform": "count-idf"}) as w:
            w.write_array("idf", np.zeros((2, 2)))
            raise RuntimeError("interrupted")
    assert Artifact(out).content_hash == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_fit_is_reproducible(small_trace, tmp_path):
    run_fit(small_trace, tmp_path / "a", decoders=3, pairs=2000, figures=False)
    run_fit(small_trace, tmp_path / "b", decoders=3, pairs=2000, figures=False)
    for sub in ("idf", "layers", "routing"):
        assert Artifact(tmp_path / "a" / sub).content_hash == Artifact(tmp_path / "b" / sub).content_hash
    routing = Artifact(tmp_path / "a" / "routing")
    assert routing.manifest["inputs"]["trace"]["content_hash"] == Artifact(small_trace).content_hash
    assert ".tmp-" not in json.dumps(routing.manifest["inputs"])  # final paths recorded


def test_manifest_schema_rejects_bad_manifests(small_trace):
    m = json.loads((small_trace / "manifest.json").read_text())
    validate_manifest(m)
    bad = dict(m, params={k: v for k, v in m["params"].items() if k != "top_k"})
    with pytest.raises(EldrError, match="top_k"):
        validate_manifest(bad)
    with pytest.raises(EldrError, match="newer than this eldr supports"):
        validate_manifest(dict(m, schema_version=99))


def test_schema_requires_the_kinds_arrays(tmp_path):
    with pytest.raises(EldrError, match="df/zarr.json"):
        with ArtifactWriter(tmp_path / "x", kind="idf", params={"transform": "count-idf"}) as w:
            w.write_array("idf", np.ones((2, 2)))
            w.metrics["n_requests"] = 1
    assert list(tmp_path.iterdir()) == []


def test_tampered_file_fails_verification(small_trace, tmp_path):
    import shutil

    copy = tmp_path / "t"
    shutil.copytree(small_trace, copy)
    (copy / "requests.parquet").write_bytes(b"not parquet")
    assert any("requests.parquet" in p for p in Artifact(copy, verify=False).verify())
    with pytest.raises(EldrError, match="requests.parquet does not match its manifest"):
        Artifact(copy)  # reading verifies


def test_row_writer_fills_whole_chunks_in_order(tmp_path, monkeypatch):
    """Batches of any size land in row order; each chunk is written once, whole (no rewrite of a
    partly filled chunk); too many or too few rows are refused."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 100, size=(23, 3, 2)).astype(np.int32)
    with ArtifactWriter(tmp_path / "a", kind="idf", params={"transform": "count-idf", "split": "all"}) as w:
        rows = w.create_rows("idf", 23, (3, 2), np.int32, chunk_rows=4)
        writes = []
        real = type(rows.arr).__setitem__
        monkeypatch.setattr(type(rows.arr), "__setitem__",
                            lambda self, key, value: (writes.append((key.start, key.stop)), real(self, key, value)))
        for a, b in ((0, 3), (3, 4), (4, 13), (13, 13), (13, 23)):
            rows.add(data[a:b])
        rows.close()
        monkeypatch.undo()
        w.write_array("df", np.zeros((3, 2), np.int32))
        w.metrics.update({"n_requests": 23, "idf_min": 0.0, "idf_max": 1.0, "cells_never_fired": 0})
        with pytest.raises(ValueError, match="more rows"):
            extra = w.create_rows("extra", 2, (), np.int32)
            extra.add(np.zeros(3, np.int32))
        short = w.create_rows("short", 5, (), np.int32)
        short.add(np.zeros(2, np.int32))
        with pytest.raises(ValueError, match="2 rows written of the 5"):
            short.close()
    np.testing.assert_array_equal(Artifact(tmp_path / "a").array("idf"), data)
    assert writes == [(0, 4), (4, 12), (12, 20), (20, 23)]  # chunk-aligned; only the tail is partial


def _draw_fails(path, why):
    raise RuntimeError(why)


def _draw_slowly(path, seconds):
    import time

    time.sleep(seconds)


def test_figures_drawn_in_background_are_the_same_bytes_and_failures_are_named(tmp_path):
    """plots.Drawing: a figure drawn in a forked process is byte-identical to one drawn in place; a
    failed one is named in one EldrError when the block ends and its artifact is not written; an
    error in the block stops the drawing processes."""
    from eldr_cli import plots

    rho = {"count-idf": 0.41, "gate-prob": 0.37}
    with plots.Drawing(background=False) as d:
        d.submit(plots.rho_per_transform, tmp_path / "inline.png", rho, "count-idf")
    with plots.Drawing(background=True) as d:
        d.submit(plots.rho_per_transform, tmp_path / "forked.png", rho, "count-idf")
        assert len(d.jobs) == 1  # really in another process
    assert (tmp_path / "forked.png").read_bytes() == (tmp_path / "inline.png").read_bytes()

    out = tmp_path / "idf"
    with pytest.raises(EldrError, match="fig7.png: RuntimeError: no ink"):
        with ArtifactWriter(out, kind="idf") as w, plots.Drawing(background=True) as d:
            w.write_array("idf", np.ones((2, 3)))
            d.submit(_draw_fails, w.figure_path("fig7.png"), "no ink")
    assert not out.exists() and not list(tmp_path.glob(".idf*"))

    with pytest.raises(KeyboardInterrupt):
        with plots.Drawing(background=True) as d:
            d.submit(_draw_slowly, tmp_path / "never.png", 60)
            procs = [p for p, _, _ in d.jobs]
            raise KeyboardInterrupt
    assert all(p.exitcode is not None for p in procs)
