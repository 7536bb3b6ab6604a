"""Serving the proxy: uvicorn (httptools + uvloop) in the foreground for the CLI. In-process
servers for tests, the demo and benchmarks are :class:`eldr_cli.testing.servers.ServerThread`."""

from __future__ import annotations

import json
import logging
import sys

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


def uvicorn_config(app, host: str, port: int, log_level: str = "warning", access_log: bool = False,
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
    uvicorn.Server(uvicorn_config(app, cfg.host, cfg.port, uv_level, cfg.access_log)).run()
