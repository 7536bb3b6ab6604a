"""The benchmarks as a package: every benchmark module imports and answers ``--help`` (in-process, and once
as ``python -m`` from the checkout's root, as the Makefile runs them); the base's paired alternation runs two
fake commands in A B, B A order and gives the interval of their per-round ratios; a result is written whole
with its environment record, or not at all."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports_and_answers_help(name):
    mod = importlib.import_module(f"benchmarks.{name}")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "--out" in buf.getvalue() and "usage:" in buf.getvalue()


def test_the_base_cli_answers_help_as_the_makefile_runs_it():
    r = subprocess.run([sys.executable, "-m", "benchmarks.base", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ") and "--before" in r.stdout and "--rounds" in r.stdout


def test_alternation_of_a_fake_pair_of_commands(tmp_path):
    from benchmarks.base import alternate_commands

    log = tmp_path / "order.txt"
    res = alternate_commands(f"printf B >> {log}", f"printf A >> {log}", rounds=3)
    assert log.read_text() == "BAABBA"  # before, after; after, before; before, after
    assert [len(res["runs"][k]) for k in ("before", "after")] == [3, 3]
    for key in ("wall_s", "cpu_s"):
        p = res[key]["ratio_after_over_before"]
        assert p["kind"] == "ratio" and p["pairs"] == 3 and len(p["per_pair"]) == 3
        assert p["ci"][0] <= p["mean"] <= p["ci"][1]
        assert p["verdict"] in ("no measurable difference", "higher after", "lower after")


def test_a_failing_command_stops_the_alternation_with_its_status(tmp_path):
    from benchmarks.base import alternate_commands

    with pytest.raises(SystemExit, match="exited with 3"):
        alternate_commands("true", "echo broken >&2; exit 3", rounds=2)


def test_paired_interval_by_hand():
    from benchmarks.base import paired_interval

    d = paired_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # differences 1, 2, 3: mean 2, sd 1
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2 degrees of freedom) * sd / sqrt(n)
    assert d["per_pair"] == [1.0, 2.0, 3.0] and d["mean"] == pytest.approx(2.0)
    assert d["ci"] == pytest.approx([2.0 - half, 2.0 + half])
    assert d["verdict"] == "no measurable difference"
    r = paired_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], ratio=True)  # ratios 2, 2, 2
    assert r["ci"] == pytest.approx([2.0, 2.0]) and r["verdict"] == "higher after"
    one = paired_interval([1.0], [2.0])
    assert math.isnan(one["ci"][0]) and one["verdict"] == "too few pairs"
    with pytest.raises(ValueError, match="as many"):
        paired_interval([1.0, 2.0], [1.0])


def test_order_alternates():
    from benchmarks.base import order

    assert [order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_result_written_whole_with_its_environment(tmp_path):
    from benchmarks.base import environment, write_result

    env = environment()
    out = write_result(tmp_path / "r" / "x.json", {"figure": 1.5, "path": tmp_path}, env)
    doc = json.loads(out.read_text())
    assert doc["figure"] == 1.5 and doc["path"] == str(tmp_path)
    e = doc["environment"]
    assert e["machine"]["cpus"] >= 1 and len(e["start"]["loadavg"]) == 3 and len(e["end"]["loadavg"]) == 3
    assert isinstance(e["start"]["others"], list) and set(e["git"]) == {"commit", "branch", "dirty"}
    with pytest.raises(TypeError):
        write_result(tmp_path / "bad.json", {"x": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # nothing half-written, no temporary left
