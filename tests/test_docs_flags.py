"""Fast checks that the documentation names only what exists: every `eldr ...` option in a ```bash
or ```console block of README.md and docs/**/*.md (skipped blocks included) appears in that
command's `--help`, and every relative Markdown link points at a file of the checkout."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ELDR = [sys.executable, "-m", "eldr_cli"]
SEPARATORS = {"&&", "||", "|", ";", "&"}
_FENCE = re.compile(r"^\s*```(?P<lang>[\w-]*)\s*$")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, logical command line) of every bash/console block; continuations joined."""
    out: list[tuple[int, str]] = []
    lang, buf, start = None, "", 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            lang = None if lang is not None else (m["lang"] or "plain")
            continue
        if lang not in ("bash", "console"):
            continue
        text = line.strip()
        if lang == "console":
            if not (text.startswith("$ ") or buf):
                continue
            text = text[2:] if text.startswith("$ ") else text
        if not buf:
            start = n
        if text.endswith("\\"):
            buf += text[:-1] + " "
            continue
        out.append((start, buf + text))
        buf = ""
    return out


def eldr_invocations(line: str) -> list[list[str]]:
    """The argument lists of every `eldr` call on one shell line."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    calls, cur, first = [], None, True  # `eldr` only counts as a command name (not `redis-cli ... eldr ...`)
    for tok in tokens + [";"]:
        if tok in SEPARATORS:
            if cur is not None:
                calls.append(cur)
            cur, first = None, True
        elif cur is not None:
            cur.append(tok)
        elif first and (tok == "eldr" or tok.endswith("/eldr")):
            cur = []
        elif "=" not in tok and tok not in ("time", "nohup", "exec", "command"):  # prefixes keep the position
            first = False
    return calls


@cache
def help_flags(path: tuple[str, ...]) -> frozenset[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200", TERM="dumb", NO_COLOR="1")
    r = subprocess.run([*ELDR, *path, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, f"`eldr {' '.join(path)} --help` failed: {r.stderr[-500:]}"
    return frozenset(_FLAG.findall(r.stdout))


def test_every_documented_option_exists():
    problems = []
    for path in doc_files():
        rel = path.relative_to(ROOT)
        for n, line in shell_lines(path):
            for args in eldr_invocations(line):
                words = []
                for a in args:  # the command path: words before the first option (positional args are harmless)
                    if a.startswith("-") or len(words) == 3:
                        break
                    words.append(a)
                if not words or words[0] == "...":
                    continue
                known = help_flags(tuple(words))
                for a in args:
                    flag = a.split("=", 1)[0]
                    if _FLAG.fullmatch(flag) and flag not in known:
                        problems.append(f"{rel}:{n}: `eldr {' '.join(words)}` has no option {flag}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    missing = []
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if not file.exists():  # no allowlist: every page linked must exist in this checkout
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"
