"""Every ```bash example in README.md and docs/**/*.md runs, so the documentation stays true.

Each fenced ```bash block is run with `bash -euo pipefail` in its own temporary workspace that looks
like a checkout after a few commands: `eldr` is this checkout's CLI (the venv's bin on PATH,
PYTHONPATH = the checkout), `eldr_cli/`, `benchmarks/`, `manifests/` and `kernels/` are links to the
checkout's, and `artifacts/` holds a copy of the fixtures built once per session (FIXTURES below):

    artifacts/trace       GENERATED trace: 200 requests, L=8, E=16, top-2, 16 decode steps, picks kept
    artifacts/fit         `eldr fit` of it, K=4 decoders (artifacts/fit/routing is the routing artifact)
    artifacts/cost-model  `eldr bench moe-layer` cost model measured on this CPU (small sizes)
    artifacts/tiny-moe    `eldr model tiny` (random weights, 4 layers, 16 experts, top-4)

A block that cannot run here carries a marker on the line before its fence, with its reason:

    <!-- doc-test: skip (needs a GPU) -->
    <!-- doc-test: skip (long: make demo) -->
    <!-- doc-test: skip (needs running vLLM workers) -->

Blocks that start servers in the background stop them themselves (`trap ... EXIT`); the test also
ends the block's whole process group afterwards. A failing block is a documentation bug.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LINKED = ("eldr_cli", "benchmarks", "manifests", "kernels")
BLOCK_TIMEOUT_S = 300  # a guard against a hung block, not a timing (the report example: minutes when loaded)

FIXTURES = """
eldr synth-trace --out artifacts/trace --requests 200 --layers 8 --experts 16 --top-k 2 \\
    --decode-steps 16 --picks
eldr fit --trace artifacts/trace --decoders 4 --pairs 2000 --out artifacts/fit
eldr bench moe-layer --out artifacts/cost-model --experts 16 --hidden 128 --intermediate 64 \\
    --top-k 2 --batches 1,8,32 --active 1,2,4,8,16 --repeats 2
eldr model tiny --out artifacts/tiny-moe
"""

_FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<directive>\w+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the checkout
    line: int  # line of the opening fence, 1-based
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _marker_before(lines: list[str], fence: int) -> re.Match[str] | None:
    """The doc-test marker on the nearest non-blank line before line index `fence`, if any."""
    for j in range(fence - 1, -1, -1):
        if lines[j].strip():
            return _MARKER.match(lines[j])
    return None


def extract_blocks(path: Path) -> list[Block]:
    """Every ```bash block of one Markdown file, with its skip reason (None: it must run)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if m["lang"] == "bash":
            marker = _marker_before(lines, i)
            reason = None
            if marker is not None:
                assert marker["directive"] == "skip", f"{path}:{i + 1}: unknown doc-test directive"
                reason = (marker["reason"] or "").strip()
                assert reason, f"{path}:{i + 1}: a doc-test skip needs a reason in brackets"
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(str(path.relative_to(ROOT)), i + 1, code, reason))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for p in doc_files() for b in extract_blocks(p)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("ELDR_ADMIN_TOKEN", None)
    env["COLUMNS"] = "100"
    return env


def run_bash(code: str, cwd: Path, timeout_s: float = BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run `code` with bash -euo pipefail in its own process group; end the whole group afterwards."""
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[doc-test] timed out after {timeout_s:.0f} s"
        return subprocess.CompletedProcess(proc.args, -9, out, err)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # servers a block left running in the background
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def doc_fixtures(tmp_path_factory) -> Path:
    """artifacts/ with the fixture artifacts the examples refer to, built once."""
    ws = tmp_path_factory.mktemp("doc-fixtures")
    result = run_bash(FIXTURES, ws, timeout_s=300)
    assert result.returncode == 0, f"fixtures failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return ws / "artifacts"


@pytest.fixture
def workspace(tmp_path, doc_fixtures) -> Iterator[Path]:
    shutil.copytree(doc_fixtures, tmp_path / "artifacts", symlinks=True)
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)  # ~10 MB per block; the failure report is already written


def test_blocks_are_found():
    """The extractor sees README's examples and at least one runnable block per command page."""
    files = {b.path for b in ALL_BLOCKS}
    assert "README.md" in files
    runnable = {b.path for b in ALL_BLOCKS if b.skip_reason is None}
    for page in sorted((ROOT / "docs" / "commands").glob("*.md")):
        rel = str(page.relative_to(ROOT))
        if rel in files:
            assert rel in runnable, f"{rel}: every bash block is skipped; give it one that runs here"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_doc_example_runs(block: Block, request):
    if block.skip_reason is not None:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    ws = request.getfixturevalue("workspace")
    result = run_bash(block.code, ws)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode}); a failing example is a documentation bug.\n"
        f"--- block ---\n{block.code}\n--- stdout (tail) ---\n{result.stdout[-3000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-3000:]}"
    )
