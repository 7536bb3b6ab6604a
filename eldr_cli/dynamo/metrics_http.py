"""``GET /metrics`` of the Dynamo router component: the proxy's Prometheus metrics (``eldr_proxy_*``), served on
the component's event loop (the collectors read the router's state between two of its steps, never during one).
The rest of HTTP is Dynamo's frontend's; this answers ``/metrics`` and 404 to anything else."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from eldr_cli.errors import EldrError

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
READ_S = 10.0  # a scraper that sends no request line and headers within this is dropped


def bind_metrics(host: str, port: int) -> socket.socket:
    """The listening socket of ``GET /metrics`` on ``host:port`` (0: any free port), bound before anything else
    starts (the decision log, the runtime) as ``serve-proxy`` binds its own: a port that cannot be listened on is
    one EldrError naming it, and nothing is left behind."""
    from eldr_cli.proxy.server import bind_socket

    if not 0 <= port <= 65535:
        raise EldrError(f"--metrics-port {port} must be in 0..65535")
    sock = bind_socket(host, port, flags=("--metrics-host", "--metrics-port"))
    sock.listen(64)
    sock.setblocking(False)
    return sock


async def serve_metrics(render: Callable[[], bytes], sock: socket.socket) -> asyncio.Server:
    """Answer ``GET /metrics`` with ``render()`` on the listening socket ``sock`` (:func:`bind_metrics`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), READ_S)
            while (await asyncio.wait_for(reader.readline(), READ_S)) not in (b"\r\n", b"\n", b""):
                pass  # the headers: nothing in them changes the answer
            parts = line.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                status, body, ctype = b"200 OK", render(), CONTENT_TYPE
            else:
                status, body, ctype = b"404 Not Found", b"only GET /metrics is served here\n", b"text/plain"
            writer.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                         % (status, ctype, len(body)) + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock)
