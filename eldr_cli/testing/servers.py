"""Servers for tests, the demo and benchmarks: any ASGI app on 127.0.0.1 in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time

from eldr_cli.proxy.server import uvicorn_config
from eldr_cli.testing.ports import free_port


class ServerThread:
    """Serve an ASGI app on 127.0.0.1 in a daemon thread: ``with ServerThread(app) as srv: srv.url``."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        import uvicorn

        self.app = app
        self.host, self.port = host, port or free_port(host)
        # in-process servers (tests, demo) stop after 1 s of grace, then cancel what still runs
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, "critical", graceful_s=1))
        self.server.install_signal_handlers = lambda: None  # not the main thread
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
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
