"""Serving the proxy: uvicorn (httptools + uvloop) in the foreground for the CLI. In-process
servers for tests, the demo and benchmarks are :class:`eldr_cli.testing.servers.ServerThread`."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from eldr_cli.errors import EldrError

if TYPE_CHECKING:
    import uvicorn

    from eldr_cli.proxy.config import ProxyConfig

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


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning", access_log: bool = False,
                   graceful_s: int = 5) -> uvicorn.Config:
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


def bind_socket(host: str, port: int, *, reuse_port: bool = False,
                flags: tuple[str, str] = ("--host", "--port")) -> socket.socket:
    """The listening socket, bound before anything is printed: a port in use (or a bad --host) is one
    message naming the flag (``flags``: the host's and the port's). ``reuse_port``: SO_REUSEPORT, so N processes
    share one port."""
    host_flag, port_flag = flags
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise EldrError(f"{host_flag} {host!r} cannot be resolved: {e.strerror}") from None
    family = infos[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EldrError(f"{port_flag} {port}: cannot listen on {host}:{port}: {e.strerror}",
                        hint=f"choose another {port_flag} (or stop what listens there)") from None
    sock.set_inheritable(True)
    return sock


def serve(cfg: ProxyConfig, sock: socket.socket | None = None) -> None:
    """Run the proxy in the foreground until interrupted (on ``sock`` when given, already bound)."""
    import uvicorn

    from eldr_cli.method.signature import blas_threads
    from eldr_cli.proxy.app import create_app

    setup_logging(cfg.log_level)
    app = create_app(cfg)
    uv_level = "info" if cfg.log_level == "debug" else "warning"
    if sock is None:
        sock = bind_socket(cfg.host, cfg.port, reuse_port=cfg.workers > 1)
    sock.listen(4096)
    # BLAS on one thread: the proxy's products are small (a decision's are K x L*E and M x d), and OpenBLAS's
    # worker threads spinning after each one cost the process more CPU than they save (measured at 200 req/s);
    # decisions are unchanged (each product's elements are computed alike on one thread or several)
    with blas_threads(1):
        uvicorn.Server(uvicorn_config(app, cfg.host, cfg.port, uv_level, cfg.access_log)).run(sockets=[sock])


def _worker_main(cfg_dict: dict[str, Any]) -> None:  # pragma: no cover - runs in a child process
    import signal

    from eldr_cli.proxy.config import ProxyConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers with SIGTERM
    cfg = ProxyConfig(**cfg_dict)
    serve(cfg, bind_socket(cfg.host, cfg.port, reuse_port=True))


def serve_workers(cfg: ProxyConfig) -> None:
    """``--workers N``: N proxy processes on one port (SO_REUSEPORT; the kernel spreads connections),
    sharing in-flight counts and run-time changes through ``cfg.state``. Without ``--state`` they share
    a private redis-server on 127.0.0.1 that lives as long as they do, with a random password and a
    random signing key (handed to the workers through their environment, never a command line)."""
    import dataclasses
    import multiprocessing as mp
    import os
    import secrets
    import signal

    from eldr_cli.proxy.replicas.auth import KEY_ENV
    from eldr_cli.proxy.replicas.conn import PASSWORD_ENV
    from eldr_cli.proxy.replicas.redis_server import RedisServer

    private, env_before = None, dict(os.environ)
    if cfg.state == "local":
        private = RedisServer(password=secrets.token_hex(16)).start()
        os.environ[PASSWORD_ENV] = private.password or ""
        os.environ[KEY_ENV] = secrets.token_hex(32)
        cfg = dataclasses.replace(cfg, state=private.url, state_key_file=None, state_password_file=None)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(dataclasses.asdict(cfg),), name=f"eldr-proxy-{i}")
             for i in range(cfg.workers)]
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.start()
        if private is not None:  # the children have their copy; the parent forgets the secrets
            os.environ.clear()
            os.environ.update(env_before)
        while not stopping and all(p.is_alive() for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if private is not None:
            private.stop()
        for sig, h in old.items():
            signal.signal(sig, h)
    dead = [p for p in procs if p.exitcode not in (0, -signal.SIGTERM, None)]
    if dead and not stopping:
        raise EldrError(f"proxy worker {dead[0].name} exited with code {dead[0].exitcode}")
