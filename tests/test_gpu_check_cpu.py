"""`make gpu-check`'s code paths run on this CPU (a dry run at tiny shapes, without polars or zarr as on a GPU
machine's bare python3), so a broken script fails CI and not the next GPU session; its GENERATED replay
fixture is what `tools/make_replay_fixture.py` builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# a GPU machine's python3 has torch, numpy, scipy, typer, rich, pandas: none of these
BARE = ("import sys, runpy\nfor m in ('polars', 'zarr', 'jsonschema', 'numba', 'matplotlib', 'sklearn', 'pyarrow'):\n"
        "    sys.modules[m] = None\n"
        "sys.argv = [{script!r}] + sys.argv[1:]\nrunpy.run_path({script!r}, run_name='__main__')\n")


@pytest.mark.slow
def test_the_dry_run_walks_every_decode_step_and_replay_section_without_polars(tmp_path):
    out = tmp_path / "gpu_check.json"
    code = BARE.format(script=str(ROOT / "benchmarks" / "gpu_check.py"))
    p = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--out", str(out)], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["label"].startswith("DRY RUN") and "kernels" not in doc and "plugin_graph" not in doc
    errors = {k: v["error"] for k, v in doc.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    mav = doc["decode_step_maverick_tp8"]
    assert {"moe", "dense", "lm_head", "step_per_moe_layer"} <= set(mav)
    assert doc["compile_fallback_check"]["raised"] is True and doc["checks_failed"] == []
    rep = doc["replay_measured"]["bf16"]
    assert {r["policy"] for r in rep["results"]} == {"round-robin", "random", "jsq", "p2c", "domain", "eldr"}
    assert all("pred_delta_expert_ms" in x for x in rep["vs_best_lb"])  # the measured step predicts beside it
    assert doc["maverick_fresh_process"]["agreement"]["points"] == len(mav["moe"]["rows"])
    w = doc["roofline_whole_step_maverick_tp8"]
    assert w["preset"] == "H200" and "24 dense layers" not in w["what"]  # the tiny shape's 2 + 2 layers
    assert "whole_step" in doc["roofline_step_compiled"]
    assert "gpu-check (DRY RUN" in p.stdout


def test_without_a_gpu_and_without_the_dry_run_flag_nothing_is_written(tmp_path, monkeypatch):
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.slow
def test_the_shipped_replay_fixture_is_what_the_tool_generates(tmp_path):
    from tools import make_replay_fixture as mk

    fresh = mk.build(tmp_path)
    shipped = np.load(mk.FIXTURE)
    assert set(shipped.files) == set(fresh)
    for k in shipped.files:
        assert np.array_equal(shipped[k], fresh[k]), k


def test_the_checks_that_must_hold_on_a_gpu_fail_the_run_when_they_do_not():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    doc = {"compile_fallback_check": {"raised": False}, "decode_step_compiled": {"compiled": True},
           "decode_step_maverick_tp8": {"compiled": False},
           "maverick_fresh_process": {"agreement": {"points": 20, "within_10pct": False}}}
    old = gpu_check.CFG["device"]
    try:
        gpu_check.CFG["device"] = "cuda"
        got = gpu_check.checks(doc)
    finally:
        gpu_check.CFG["device"] = old
    assert len(got) == 3 and any("fresh process" in c for c in got) and any("maverick" in c for c in got)
