"""HTTP plumbing of the proxy: ASGI send helpers, OpenAI-style error bodies, request-body checks and
the upstream GET used by health checks (the legs' one error: :class:`eldr_cli.proxy.upstream.UpstreamError`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

from eldr_cli.errors import EldrError
from eldr_cli.proxy.workers import Worker

# ASGI, as the proxy uses it (uvicorn passes plain dicts)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
JSON_HEADER = (b"content-type", b"application/json")
SSE_HEADER = (b"content-type", b"text/event-stream; charset=utf-8")


def error_body(message: str, type_: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def validate_body(body: Any, endpoint: str) -> str | None:
    """The reason a request body is unacceptable, or None. Deliberately shallow: the worker
    validates the rest; this catches what would break the PD flow itself."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a string 'role'"
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (isinstance(p, list) and p and (
            all(isinstance(x, str) for x in p) or all(isinstance(x, int) for x in p)
            or all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in p)))
        if not ok:
            return "'prompt' must be a string, a list of strings, or token ids"
    if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
        return "'stream' must be a boolean"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"'{key}' must be a non-negative integer"
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        return "'model' must be a string"
    return None


class Refused(EldrError):
    """An admin request refused: the message goes back to the caller with HTTP ``status``."""

    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


async def http_get(w: Worker, path: str, timeout: float) -> tuple[int, bytes]:
    resp = None
    try:
        async with asyncio.timeout(timeout):
            resp = await w.pool().request("GET", path)
            return int(resp.status), await resp.read()
    finally:
        if resp is not None:
            resp.release()


async def wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def send_bytes(send: Send, status: int, body: bytes, headers: Headers) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: Headers = ()) -> None:
    await send_bytes(send, status, orjson.dumps(obj), [JSON_HEADER, *headers])
