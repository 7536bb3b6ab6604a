"""A benchmark's arguments, the record of what it ran on, and its JSON output.

Every result file carries ``environment``: the machine (platform, Python, cores, the cores this process
may use), the git commit of the checkout (and whether it had uncommitted changes), and at start and at
end the load average and the other processes that were using the CPU ("what else ran"), so a figure
is never read without the conditions it was measured under.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(PY).parent


def parser(doc: str | None, out: str) -> argparse.ArgumentParser:
    """The benchmark's argument parser: its docstring's first line as the description, the rest as the
    epilog of ``--help``, and ``--out`` (the JSON file written, default ``out``)."""
    first, _, rest = (doc or "").strip().partition("\n")
    script = Path(sys.argv[0])
    prog = f"python -m benchmarks.{script.stem}" if script.parent.name == "benchmarks" else None
    ap = argparse.ArgumentParser(prog=prog, description=first, epilog=rest.strip() or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help="the JSON file written (default: %(default)s)")
    return ap


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The checkout's commit, branch and whether tracked files differ from it (None where git is absent)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": None if status is None else bool(status)}


def busy_processes(sample_s: float = 0.3, top: int = 8, min_pct: float = 5.0) -> list[dict[str, Any]]:
    """Other processes using at least ``min_pct`` % of a core over ``sample_s`` seconds, busiest first."""
    try:
        import psutil
    except ImportError:
        return []
    me = os.getpid()
    procs = [p for p in psutil.process_iter(["pid", "name"]) if p.pid != me]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(sample_s)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
            if pct >= min_pct:
                busy.append({"pid": p.pid, "name": p.info["name"], "cpu_pct": round(pct, 1),
                             "cmd": " ".join(p.cmdline())[:160]})
        except psutil.Error:
            pass
    return sorted(busy, key=lambda b: -b["cpu_pct"])[:top]


def snapshot() -> dict[str, Any]:
    """The time, the load average and what else was using the CPU, now."""
    return {"utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "loadavg": list(os.getloadavg()),
            "others": busy_processes()}


def environment() -> dict[str, Any]:
    """The record of the machine and the checkout, with a :func:`snapshot` as ``start``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "python": platform.python_version(), "cpus": os.cpu_count(), "cpus_usable": cores},
            "git": git_state(), "argv": sys.argv[1:], "start": snapshot()}


def _default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    return float(x)


def write_result(out: str | Path, result: dict[str, Any], env: dict[str, Any] | None = None) -> Path:
    """Write ``result`` (with ``environment``: ``env`` plus a :func:`snapshot` as ``end``) to ``out`` as
    JSON, whole or not at all (a temporary file renamed into place). -> the path written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(result)
    if env is not None:
        doc["environment"] = {**env, "end": snapshot()}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2, default=_default) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
