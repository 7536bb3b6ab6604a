"""The package installs from a wheel and works outside the checkout.

Builds the wheel from a clean copy of the sources (no stale ``build/``), installs it into a fresh
virtual environment (no system site-packages) together with the dependencies *the wheel declares*,
pinned to requirements.lock through a constraints file (pip takes them from its configured wheel
cache/index, as ``make venv`` does), then runs ``eldr synth-trace`` and ``eldr fit`` from a directory
outside the checkout and validates the artifacts with the installed package. A dependency missing
from pyproject.toml, a schema missing from the wheel, or a path into the source tree fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, timeout=600):
    # PYTHONPATH (how the worktree is tested) would put the checkout on sys.path: drop it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n"
                               f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("eldr_cli", "kernels", "manifests"):  # eldr_cli/kernels and eldr_cli/schemas are links
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src], cwd=dist)
    (whl,) = dist.glob("eldr-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("eldr-")}
    assert tops == {"eldr_cli"}, f"the wheel installs top-level packages besides eldr_cli: {tops}"
    schemas = {Path(n).name for n in names if n.startswith("eldr_cli/schemas/")}
    assert {p.name for p in (ROOT / "manifests").glob("*.json")} <= schemas
    assert "eldr_cli/kernels/signature_cache.py" in names
    assert {"eldr_cli/data/prompts/task.jsonl", "eldr_cli/data/prompts/language.jsonl"} <= set(names)


def test_wheel_installs_and_fits_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    py, eldr = venv / "bin" / "python", venv / "bin" / "eldr"
    lock = [ln for ln in (ROOT / "requirements.lock").read_text().splitlines() if ln and not ln.startswith("#")]
    (tmp_path / "constraints.txt").write_text("\n".join(lock) + "\n")
    _run([py, "-m", "pip", "install", "-q", "-c", tmp_path / "constraints.txt", wheel], cwd=tmp_path, timeout=900)

    work = tmp_path / "work"
    work.mkdir()
    _run([eldr, "synth-trace", "--out", "trace", "-n", "400", "--layers", "8", "--experts", "32", "--top-k", "4"],
         cwd=work)
    _run([eldr, "fit", "--trace", "trace", "--decoders", "4", "--out", "fit", "--pairs", "2000"], cwd=work)

    check = """
import json, sys
import eldr_cli
from eldr_cli.artifacts import store
from eldr_cli.routing import RoutingModel
for sub, kind in (("fit", "fit"), ("fit/idf", "idf"), ("fit/layers", "layers"), ("fit/routing", "routing")):
    store.Artifact(sub, kind=kind)  # validates the manifest against the installed JSON Schema
model = RoutingModel.load("fit/routing")
print(json.dumps({"eldr_cli": eldr_cli.__file__, "schemas": str(store.MANIFESTS_DIR),
                  "k": int(model.centroids.shape[0]), "path": sys.path}))
"""
    out = json.loads(_run([py, "-c", check], cwd=work).stdout.strip().splitlines()[-1])
    site = venv.resolve()
    assert Path(out["eldr_cli"]).resolve().is_relative_to(site), out["eldr_cli"]
    assert Path(out["schemas"]).resolve().is_relative_to(site), out["schemas"]
    assert not any(Path(p).resolve() == ROOT for p in out["path"] if p)
    assert out["k"] == 4
    assert list((work / "fit" / "layers").glob("*.png")), "figures need matplotlib, a declared dependency"
