"""Servers for tests, the demo and benchmarks: any ASGI app on 127.0.0.1 in a background thread, and
waiting for a server (or the file it writes when ready) in another process."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from eldr_cli.testing.ports import free_port


class ServerThread:
    """Serve an ASGI app on 127.0.0.1 in a daemon thread: ``with ServerThread(app) as srv: srv.url``."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        import uvicorn

        from eldr_cli.proxy.server import uvicorn_config

        self.app = app
        self.host, self.port = host, port or free_port(host)
        # in-process servers (tests, demo) stop after 1 s of grace, then cancel what still runs
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, "critical", graceful_s=1))
        self.server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # not the main thread
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"asgi-{self.port}")
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self):
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop (e.g. ``app.check_health_once()``) and return its result."""
        assert self.loop is not None, "call start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _exited(proc: subprocess.Popen | None, what: str, log: Path | None) -> None:
    if proc is not None and proc.poll() is not None:
        tail = ""
        if log is not None:
            try:
                tail = ":\n" + Path(log).read_text(errors="replace")[-3000:]
            except OSError:
                pass
        raise RuntimeError(f"the process serving {what} exited with {proc.returncode}{tail}")


def wait_http(url: str, timeout: float = 60.0, *, proc: subprocess.Popen | None = None, log: Path | None = None,
              interval: float = 0.2) -> None:
    """Return once GET ``url`` answers 200 (e.g. ``.../health``); RuntimeError after ``timeout`` s, or at
    once if ``proc`` (the process that should serve it) exited, with the tail of its ``log``."""
    t0 = time.monotonic()
    while True:
        _exited(proc, url, log)
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{url} did not come up within {timeout:.0f} s" + (f"; see {log}" if log else ""))
        time.sleep(interval)


def wait_file(path: Path, timeout: float = 60.0, *, proc: subprocess.Popen | None = None, log: Path | None = None,
              interval: float = 0.1) -> Path:
    """Return ``path`` once it exists (e.g. the ``--cluster-file`` ``eldr emulate`` writes atomically when
    every port listens); RuntimeError after ``timeout`` s or at once if ``proc`` exited."""
    path = Path(path)
    t0 = time.monotonic()
    while not path.exists():
        _exited(proc, str(path), log)
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{path} did not appear within {timeout:.0f} s" + (f"; see {log}" if log else ""))
        time.sleep(interval)
    return path
