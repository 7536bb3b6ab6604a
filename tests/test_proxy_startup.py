"""`eldr serve-proxy` start-up errors: checked before the "serving on" banner, one message naming the
flag, exit 2, no traceback (the real executable)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

BASE = ["--policy", "jsq", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]


def _run(args, extra_env=None, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="200", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "eldr_cli", "serve-proxy", *args], capture_output=True, text=True,
                          env=env, timeout=60, **kw)


@pytest.mark.parametrize("args,flag", [
    (["--policy", "jsq", "--prefill", "http://127.0.0.1:99999", "--decode", "http://127.0.0.1:9"], "--prefill"),
    (["--policy", "jsq", "--prefill", "http://127.0.0.1:9", "--decode", "http://:abc"], "--decode"),
    (["--policy", "jsq", "--prefill", "http://:8000", "--decode", "http://127.0.0.1:9"], "--prefill"),
    (["--policy", "jsq", "--prefill", "https://127.0.0.1:9", "--decode", "http://127.0.0.1:9"], "--prefill"),
    ([*BASE, "--port", "70000"], "--port"),
    ([*BASE, "--port", "0"], "--port"),
    ([*BASE, "--state", "redis://nohost"], "--state"),
    ([*BASE, "--state", "memcached://127.0.0.1:1"], "--state"),
    ([*BASE, "--workers", "0"], "--workers"),
])
def test_bad_startup_options(args, flag):
    r = _run(args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "serve-proxy on" not in r.stdout  # nothing announced
    assert flag in r.stderr


def test_decision_log_under_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("mine")
    r = _run([*BASE, "--decision-log", str(f / "d.jsonl")])
    assert r.returncode == 2 and "--decision-log" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "mine"


def test_port_in_use_is_refused_before_the_banner():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run([*BASE, "--port", str(s.getsockname()[1])])
    assert r.returncode == 2 and "--port" in r.stderr and "in use" in r.stderr
    assert "serve-proxy on" not in r.stdout and "Traceback" not in r.stderr


def test_workers_without_a_redis_server_is_refused_before_the_banner(tmp_path):
    r = _run([*BASE, "--workers", "2"], extra_env={"ELDR_REDIS_SERVER": str(tmp_path / "no-such-redis-server")})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "serve-proxy on" not in r.stdout
    assert "--workers 2" in r.stderr and "ELDR_REDIS_SERVER" in r.stderr
