"""Serving the proxy: uvicorn (httptools + uvloop) in the foreground for the CLI, or in a
background thread (:class:`ServerThread`) for tests, the demo and benchmarks."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time

_STD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and every ``extra=`` field (request_id, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    lg = logging.getLogger("eldr")
    if not any(isinstance(h.formatter, JsonFormatter) for h in lg.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(JsonFormatter())
        lg.addHandler(h)
        lg.propagate = False
    lg.setLevel(level.upper())


def _uvicorn_config(app, host: str, port: int, log_level: str = "warning", access_log: bool = False,
                    graceful_s: float = 5):
    import uvicorn

    loop = "uvloop"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        loop = "asyncio"
    return uvicorn.Config(app, host=host, port=port, loop=loop, http="httptools", lifespan="on",
                          log_level=log_level, access_log=access_log, timeout_graceful_shutdown=graceful_s,
                          backlog=4096, timeout_keep_alive=30, proxy_headers=False,
                          server_header=False, date_header=False)


def serve(cfg) -> None:
    """Run the proxy in the foreground until interrupted."""
    import uvicorn

    from eldr_cli.proxy.app import create_app

    setup_logging(cfg.log_level)
    app = create_app(cfg)
    uv_level = "info" if cfg.log_level == "debug" else "warning"
    uvicorn.Server(_uvicorn_config(app, cfg.host, cfg.port, uv_level, cfg.access_log)).run()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Serve an ASGI app on 127.0.0.1 in a daemon thread: ``with ServerThread(app) as srv: srv.url``."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        import uvicorn

        self.app = app
        self.host, self.port = host, port or free_port(host)
        # in-process servers (tests, demo) stop after 1 s of grace, then cancel what still runs
        self.server = uvicorn.Server(_uvicorn_config(app, self.host, self.port, "critical", graceful_s=1))
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
