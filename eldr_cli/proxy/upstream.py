"""A lean HTTP/1.1 client for the proxy's upstream legs: one keep-alive connection pool per worker,
responses parsed by httptools (the C parser uvicorn uses), bodies read whole or streamed chunk by
chunk as they arrive.

Why not aiohttp: the proxy makes two upstream requests per client request, and on a small machine
the client library's per-request Python work was the largest part of the proxy's CPU cost (see
benchmarks/bench_proxy.py). This client does only what the PD legs need: POST/GET with a known
body, Content-Length or chunked responses, explicit timeouts, and closing the connection when a
leg is abandoned (which makes vLLM abort the request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The one error of an upstream leg, by ``kind``: "connect" (nothing was sent), "timeout", "closed" (the
    connection was lost mid-answer or the answer was not HTTP), "status" (an error status: ``status`` and the
    answer's ``body``) or "bad_answer" (not the JSON the leg expects). ``reason``: what to tell the client."""

    KINDS = ("connect", "timeout", "closed", "status", "bad_answer")

    def __init__(self, kind: str, reason: str, status: int | None = None, body: bytes | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.status, self.body = kind, reason, status, body


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "parser", "status", "headers", "chunks", "buffered", "done", "closed",
                 "keep_alive", "waiter", "paused", "got_bytes", "until_eof")

    HIGH_WATER = 1 << 18

    pool: HttpPool
    transport: asyncio.Transport  # set by connection_made, before create_connection returns the protocol
    parser: httptools.HttpResponseParser
    status: int | None
    headers: dict[str, str]
    chunks: list[bytes]
    buffered: int
    done: bool
    closed: bool
    keep_alive: bool
    waiter: asyncio.Future[None] | None
    paused: bool
    got_bytes: bool
    until_eof: bool

    def __init__(self, pool: HttpPool):
        self.pool = pool
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = None
        self.headers = {}
        self.chunks = []
        self.buffered = 0
        self.done = False
        self.keep_alive = False
        self.waiter = None
        self.paused = False
        self.got_bytes = False
        self.until_eof = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.closed = True
            self.transport.close()
            self._wake(UpstreamError("closed", f"bad HTTP from upstream: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_eof and self.status is not None and not self.done:
            self.done = True  # body delimited by connection close
            self._wake(None)
        elif not self.done:
            self._wake(UpstreamError("closed", "upstream closed the connection"
                                         + ("" if exc is None else f" ({type(exc).__name__})")))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.until_eof = ("content-length" not in self.headers
                          and "chunked" not in self.headers.get("transfer-encoding", "").lower())
        self._wake(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > self.HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake(None)

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake(None)

    def _wake(self, exc: BaseException | None) -> None:
        w = self.waiter
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    async def wait(self, timeout: float | None) -> None:
        """Wait for the next parser event (headers, body chunk, end, or loss)."""
        loop = self.pool.loop
        self.waiter = fut = cast("asyncio.Future[None]", loop.create_future())
        h = None
        if timeout is not None:
            h = loop.call_later(timeout, _expire, fut, timeout)
        try:
            await fut
        finally:
            self.waiter = None
            if h is not None:
                h.cancel()


def _expire(fut: asyncio.Future[None], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(UpstreamError("timeout", f"no data from upstream for {timeout:g} s"))


class Response:
    __slots__ = ("conn", "status", "headers", "_finished")

    def __init__(self, conn: _Conn, status: int):
        self.conn = conn
        self.status = status
        self.headers = conn.headers
        self._finished = False

    async def read(self, timeout: float | None = None) -> bytes:
        c = self.conn
        parts: list[bytes] = []
        while True:
            if c.chunks:
                parts += c.chunks
                c.chunks, c.buffered = [], 0
                if c.paused:  # drained: let the transport read again
                    c.paused = False
                    c.transport.resume_reading()
            if c.done:
                return b"".join(parts)
            if c.closed:
                raise UpstreamError("closed", "upstream closed the connection mid-answer")
            await c.wait(timeout)

    async def iter_chunks(self, timeout: float | None = None) -> AsyncIterator[bytes]:
        c = self.conn
        while True:
            if c.chunks:
                chunks, c.chunks, c.buffered = c.chunks, [], 0
                if c.paused:
                    c.paused = False
                    c.transport.resume_reading()
                for ch in chunks:
                    yield ch
                continue
            if c.done:
                return
            if c.closed:
                raise UpstreamError("closed", "upstream closed the connection mid-answer")
            await c.wait(timeout)

    @property
    def complete(self) -> bool:
        return self.conn.done and not self.conn.chunks

    def release(self) -> None:
        """Give the connection back to the pool if the answer was read to its end, else close it."""
        if self._finished:
            return
        self._finished = True
        c = self.conn
        if c.done and c.keep_alive and not c.closed and not c.chunks:
            c._reset()
            self.conn.pool._put(c)
        else:
            self.close()

    def close(self) -> None:
        self._finished = True
        c = self.conn
        c.closed = True
        if c.transport is not None:
            c.transport.close()


class HttpPool:
    """Keep-alive connections to one upstream ``http://host:port`` (TLS is not supported)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, max_idle: int = 256):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"upstream {base_url}: only http:// workers are supported")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.host_header = (u.netloc or self.host).encode("latin-1")
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Conn] = []
        self.closed = False

    def _put(self, c: _Conn) -> None:
        if self.closed or len(self._idle) >= self.max_idle:
            c.closed = True
            c.transport.close()
        else:
            self._idle.append(c)

    async def _connect(self) -> _Conn:
        try:
            _, c = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Conn(self), self.host, self.port), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} timed out") from None
        except OSError as e:
            raise UpstreamError("connect", f"cannot connect to {self.host}:{self.port}: "
                                               f"{e.strerror or type(e).__name__}") from None
        return c

    async def request(self, method: str, path: str, body: bytes = b"", headers: Sequence[tuple[str, str]] = (),
                      timeout: float | None = None) -> Response:
        """Send a request and wait for the response head (at most ``timeout`` s of silence)."""
        head = [f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self.host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        msg = b"".join(head) + body
        for attempt in range(2):
            reused = False
            c = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed and not c.transport.is_closing():
                    reused = True
                    break
                c = None
            if c is None:
                c = await self._connect()
            c.transport.write(msg)
            try:
                while c.status is None:
                    if c.closed:
                        raise UpstreamError("closed", "upstream closed the connection before answering")
                    await c.wait(timeout)
            except UpstreamError as e:
                c.closed = True
                c.transport.close()
                # a kept-alive connection the server had already closed: resend once on a fresh one
                if reused and attempt == 0 and e.kind == "closed" and not c.got_bytes:
                    continue
                raise
            except BaseException:
                c.closed = True
                c.transport.close()
                raise
            return Response(c, c.status)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self.closed = True
        for c in self._idle:
            c.closed = True
            c.transport.close()
        self._idle.clear()
