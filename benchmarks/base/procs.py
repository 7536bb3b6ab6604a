"""Processes of the serving benchmarks: started in their own session (so stopping one stops its children),
stopped by process group, their CPU and memory read with psutil, their Prometheus metrics parsed."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

from benchmarks.base.env import ROOT


def spawn(cmd: list[str], log: Path | str, env: Mapping[str, str] | None = None,
          cwd: Path = ROOT) -> subprocess.Popen:
    """Start ``cmd`` in ``cwd`` (the checkout's root), in a new session, its output into ``log``. ``python -m``
    puts ``cwd`` before ``PYTHONPATH`` on the path: run another tree's ``eldr_cli`` with ``cwd`` = that tree."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, cwd=cwd)


def stop(p: subprocess.Popen | None) -> None:
    """SIGTERM to the process group of ``p``, SIGKILL after 10 s; nothing when it has already exited."""
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (held together while chosen, so they differ)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def flags(name: str, values: Iterable[str]) -> list[str]:
    """``--name v1 --name v2 ...``"""
    return [x for v in values for x in (name, v)]


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children (threads included)."""
    import psutil

    p = psutil.Process(pid)
    t = p.cpu_times()
    total = t.user + t.system
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return total


def metrics(url: str) -> dict[str, list[tuple[str, float]]]:
    """GET ``url``/metrics: metric name -> [(labels, value)]."""
    import httpx

    out: dict[str, list[tuple[str, float]]] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)", line)
        if m:
            out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out
