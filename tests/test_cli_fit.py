"""The fit commands end to end, and every bad input: one message, exit 2, no partial output."""

import json
import subprocess
import sys

import numpy as np
import pytest

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.artifacts.trace import write_trace
from eldr_cli.main import run
from eldr_cli.synth import synthetic_trace


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "trace"
    write_trace(d, synthetic_trace(150, 8, 16, 2, seed=0))
    return d


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_stagewise_fit_and_inspect(trace_dir, tmp_path, capsys):
    assert run(["fit-idf", "--trace", str(trace_dir), "--out", str(tmp_path / "idf")]) == 0
    assert run(["select-layers", "--trace", str(trace_dir), "--idf", str(tmp_path / "idf"),
                "--out", str(tmp_path / "layers"), "--pairs", "3000"]) == 0
    assert run(["cluster", "--trace", str(trace_dir), "--layers", str(tmp_path / "layers"),
                "--decoders", "4", "--out", str(tmp_path / "routing")]) == 0
    assert (tmp_path / "layers" / "fig7_rho_per_transform.png").stat().st_size > 1000
    assert (tmp_path / "layers" / "fig8_cumulative_rho.png").stat().st_size > 1000
    assert (tmp_path / "routing" / "fig9_pca.png").stat().st_size > 1000
    r = Artifact(tmp_path / "routing")
    K, d = r.array("centroids").shape
    assert K == 4 and d == len(r.array("mask")) * 16
    np.testing.assert_allclose(np.linalg.norm(r.array("centroids"), axis=1), 1.0)
    assert max(r.metrics["cluster_sizes"]) <= r.metrics["capacity"]
    capsys.readouterr()
    assert run(["inspect", str(tmp_path / "routing")]) == 0
    assert "valid" in capsys.readouterr().out


def test_fit_command_writes_all_sub_artifacts(trace_dir, tmp_path):
    assert run(["fit", "--trace", str(trace_dir), "--decoders", "3", "--out", str(tmp_path / "fit"),
                "--pairs", "2000", "--no-figures"]) == 0
    for sub in ("idf", "layers", "routing"):
        assert Artifact(tmp_path / "fit" / sub).kind == sub
    assert Artifact(tmp_path / "fit").kind == "fit"


def test_fit_states_eldr_live_predictors_on_the_held_back_split(trace_dir, tmp_path, capsys):
    """Issue 35: the routing manifest and fit's output give every candidate's held-back error beside the served one
    and the clairvoyant's zero; the served one is a servable candidate and its arrays are in the artifact."""
    assert run(["fit", "--trace", str(trace_dir), "--decoders", "3", "--out", str(tmp_path / "fit"),
                "--pairs", "2000", "--no-figures"]) == 0
    out = capsys.readouterr().out
    art = Artifact(tmp_path / "fit" / "routing")
    q = art.metrics["live_predictor_quality"]
    assert set(q) == {"prototype", "shrinkage-global", "shrinkage", "own", "knn-8", "clairvoyant"}
    assert q["clairvoyant"]["brier"] == 0 and q["clairvoyant"]["union_err_pct_b64"] == 0
    assert all(q[c]["brier"] > 0 for c in q if c != "clairvoyant")
    chosen = art.params["live_predictor"]
    assert chosen in ("prototype", "shrinkage-global", "shrinkage")
    assert q[chosen]["brier"] <= q["prototype"]["brier"]
    assert art.array("live_kappa").shape == art.array("live_weight").shape == (8,)
    assert "eldr-live decode-activation predictor" in out and f"{chosen} *" in out
    lay = Artifact(tmp_path / "fit" / "layers").metrics
    assert lay["layer_weight_rho"]["rho_learned_check_half"] >= lay["layer_weight_rho"]["rho_plain_check_half"]


def _expect_error(argv, capsys, *needles, out=None):
    rc = run(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    if out is not None:
        assert not out.exists()
        assert _leftovers(out.parent) == []
    return err


def _raw_trace(path, prefill, decode, steps, L=None, E=None):
    """A trace artifact written without write_trace's validation (to test the readers)."""
    import polars as pl

    R = prefill.shape[0]
    L = L or prefill.shape[1]
    E = E or prefill.shape[2]
    with ArtifactWriter(path, kind="trace", params={"model": "x", "num_layers": L, "num_experts": E, "top_k": 2,
                                                    "moe_layer_ids": list(range(L))}) as w:
        w.write_array("prefill_counts", prefill)
        w.write_array("decode_counts", decode)
        w.write_array("decode_steps", steps)
        w.write_table("requests", pl.DataFrame({
            "request_id": [str(i) for i in range(R)], "domain": ["a"] * R, "language": ["en"] * R,
            "prompt_tokens": [1] * R, "decode_tokens": [1] * R, "source": ["t"] * R,
            "split": ["calibration"] * R, "prompt": ["p"] * R}))
        w.metrics["n_requests"] = R


def test_missing_trace(tmp_path, capsys):
    _expect_error(["fit", "--trace", str(tmp_path / "nope"), "--decoders", "2", "--out", str(tmp_path / "o")],
                  capsys, "does not exist", out=tmp_path / "o")


def test_foreign_directory_and_wrong_kind(trace_dir, tmp_path, capsys):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.csv").write_text("a,b\n")
    _expect_error(["fit-idf", "--trace", str(tmp_path / "foreign"), "--out", str(tmp_path / "o")],
                  capsys, "not an eldr artifact", out=tmp_path / "o")
    run(["fit-idf", "--trace", str(trace_dir), "--out", str(tmp_path / "idf")])
    capsys.readouterr()
    _expect_error(["fit-idf", "--trace", str(tmp_path / "idf"), "--out", str(tmp_path / "o")],
                  capsys, "is a 'idf' artifact; expected trace", out=tmp_path / "o")


def test_newer_schema_version(trace_dir, tmp_path, capsys):
    import shutil

    t = tmp_path / "t"
    shutil.copytree(trace_dir, t)
    m = json.loads((t / "manifest.json").read_text())
    m["schema_version"] = 7
    (t / "manifest.json").write_text(json.dumps(m))
    _expect_error(["fit", "--trace", str(t), "--decoders", "2", "--out", str(tmp_path / "o")],
                  capsys, "schema version 7", "newer", out=tmp_path / "o")


def test_mismatched_shapes(tmp_path, capsys):
    _raw_trace(tmp_path / "t", np.ones((5, 3, 4), np.int32), np.ones((5, 3, 5), np.int32), np.ones(5, np.int32),
               E=4)
    _expect_error(["fit", "--trace", str(tmp_path / "t"), "--decoders", "2", "--out", str(tmp_path / "o")],
                  capsys, "decode_counts has shape", out=tmp_path / "o")


def test_nan_counts(tmp_path, capsys):
    pc = np.ones((5, 3, 4), np.float32)
    pc[1, 1, 1] = np.nan
    _raw_trace(tmp_path / "t", pc, np.ones((5, 3, 4), np.int32), np.ones(5, np.int32))
    _expect_error(["fit", "--trace", str(tmp_path / "t"), "--decoders", "2", "--out", str(tmp_path / "o")],
                  capsys, "NaN", out=tmp_path / "o")


def test_negative_counts(tmp_path, capsys):
    pc = np.ones((5, 3, 4), np.int32)
    pc[0, 0, 0] = -3
    _raw_trace(tmp_path / "t", pc, np.ones((5, 3, 4), np.int32), np.ones(5, np.int32))
    _expect_error(["fit-idf", "--trace", str(tmp_path / "t"), "--out", str(tmp_path / "o")],
                  capsys, "negative", out=tmp_path / "o")


def test_empty_trace(tmp_path, capsys):
    _raw_trace(tmp_path / "t", np.zeros((0, 3, 4), np.int32), np.zeros((0, 3, 4), np.int32),
               np.zeros(0, np.int32))
    _expect_error(["fit", "--trace", str(tmp_path / "t"), "--decoders", "2", "--out", str(tmp_path / "o")],
                  capsys, "empty", out=tmp_path / "o")


@pytest.mark.parametrize("k", ["0", "-1", "500"])
def test_k_out_of_range(trace_dir, tmp_path, capsys, k):
    _expect_error(["fit", "--trace", str(trace_dir), "--decoders", k, "--out", str(tmp_path / "o"),
                   "--pairs", "500", "--no-figures"], capsys, "K must be between 1 and", out=tmp_path / "o")


def test_stage_inputs_from_another_trace(trace_dir, tmp_path, capsys):
    other = tmp_path / "other"
    write_trace(other, synthetic_trace(60, 8, 16, 2, seed=9))
    run(["fit-idf", "--trace", str(other), "--out", str(tmp_path / "idf")])
    capsys.readouterr()
    _expect_error(["select-layers", "--trace", str(trace_dir), "--idf", str(tmp_path / "idf"),
                   "--out", str(tmp_path / "o")], capsys, "fitted on another trace", out=tmp_path / "o")


def test_unknown_transform(trace_dir, tmp_path, capsys):
    run(["fit-idf", "--trace", str(trace_dir), "--out", str(tmp_path / "idf")])
    capsys.readouterr()
    _expect_error(["select-layers", "--trace", str(trace_dir), "--idf", str(tmp_path / "idf"),
                   "--out", str(tmp_path / "o"), "--transform", "cubic"], capsys, "unknown transform",
                  out=tmp_path / "o")


def test_console_script_exit_code_and_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "eldr_cli", "fit", "--trace", str(tmp_path / "missing"),
                        "--decoders", "2", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()


def test_fit_exits_without_teardown_after_a_complete_run(trace_dir, tmp_path):
    """`eldr fit` skips the interpreter's teardown once its artifact is in place: the whole summary
    still reaches a pipe and the exit code is 0."""
    args = [sys.executable, "-m", "eldr_cli", "fit", "--trace", str(trace_dir), "--decoders", "4",
            "--pairs", "3000", "--no-figures", "--out", str(tmp_path / "fit")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "fit took" in "".join(r.stdout.rstrip().splitlines()[-2:]), r.stdout
    assert "Traceback" not in r.stderr
    assert Artifact(tmp_path / "fit" / "routing").metrics["n_signatures"] > 0
    assert not _leftovers(tmp_path)
