"""The PD exchange of one client request (vLLM's disaggregated-serving protocol; see eldr_cli.proxy.app): the
HTTP legs. Read and check the body, prefill leg, the hand-off to the app's :class:`eldr_cli.proxy.dispatch.
Dispatcher` (decide, hold, reserve, record, shadows), decode leg streamed back. Every request carries a typed
:class:`RequestContext` and ends in exactly one terminal outcome; an upstream failure is one
:class:`eldr_cli.proxy.upstream.UpstreamError` whose kind names it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from eldr_cli.proxy.dispatch import Dispatcher, Handoff
from eldr_cli.proxy.http import (
    JSON_HEADER,
    SSE_HEADER,
    Receive,
    Scope,
    Send,
    error_body,
    send_bytes,
    send_json,
    validate_body,
    wait_disconnect,
)
from eldr_cli.proxy.request import RequestContext, prefill_body
from eldr_cli.proxy.upstream import UpstreamError
from eldr_cli.proxy.workers import Worker, WorkerPool
from eldr_cli.routing import Decision
from eldr_cli.routing.prefill import PrefixHashPrefill, prompt_key

if TYPE_CHECKING:
    from eldr_cli.proxy.config import ProxyConfig
    from eldr_cli.proxy.metrics import ProxyMetrics

log = logging.getLogger("eldr.proxy")
PREFILL_LABEL = {"connect": "connection", "closed": "connection"}  # eldr_proxy_upstream_errors' kinds, per leg

class RequestCounts(Protocol):
    """The app's request counters (:class:`eldr_cli.proxy.base.ProxyState` holds them; metrics and tests read them)."""

    started: int
    in_progress: int
    outcomes: dict[str, int]


class InFlight(Protocol):
    """What the legs need of the shared state (:mod:`eldr_cli.proxy.replicas.shared`): a note that this replica's
    in-flight counts changed, and a request's reserved decode slot given back."""

    def note_change(self) -> None: ...

    def release(self, request: Any) -> None: ...


class Exchange:
    """The generate endpoints of :class:`eldr_cli.proxy.app.ProxyApp`, built from explicit parts: the config (body
    limit, timeouts), the metrics, the prefill pool and its chooser, the shared state's in-flight side, the request
    counters and ``dispatch``, the hand-off (the app replaces it on every admin swap)."""

    def __init__(self, cfg: ProxyConfig, metrics: ProxyMetrics, prefill: WorkerPool, prefix: PrefixHashPrefill,
                 shared: InFlight, counts: RequestCounts, dispatch: Dispatcher):
        self.cfg, self.metrics, self.prefill, self.prefix = cfg, metrics, prefill, prefix
        self.shared, self.counts, self.dispatch = shared, counts, dispatch

    # -- the generate path ----------------------------------------------------------------------
    async def generate(self, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.counts
        st.started += 1
        st.in_progress += 1
        rid = None
        domain = None
        auth = None
        clen = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode("latin-1")
            elif k == b"x-eldr-domain":
                domain = v.decode("utf-8", "replace")
            elif k == b"authorization":
                auth = v
            elif k == b"content-length":
                clen = v
        rid = rid or uuid.uuid4().hex
        ctx = RequestContext(rid=rid, endpoint=endpoint, domain=domain, auth=auth)
        outcome = "cancelled"
        try:
            outcome = await self._generate_inner(ctx, clen, receive, send)
        finally:
            st.outcomes[outcome] = st.outcomes.get(outcome, 0) + 1
            self.dispatch.finish(rid)
            self.metrics.child(self.metrics.requests, endpoint, outcome).inc()
            st.in_progress -= 1  # last: tests in other threads wait for 0, then read the outcome
            if log.isEnabledFor(logging.INFO):
                log.info("request", extra={"event": "request", "request_id": rid, "endpoint": endpoint,
                                           "outcome": outcome, "prefill": ctx.prefill,
                                           "decode": ctx.decode, "policy": ctx.policy,
                                           "reason": ctx.reason,
                                           "ms": round((time.perf_counter() - ctx.t0) * 1e3, 3)})

    async def _generate_inner(self, ctx: RequestContext, clen: bytes | None, receive: Receive, send: Send) -> str:
        limit = self.cfg.max_body_bytes
        rid_h = (b"x-request-id", ctx.rid.encode("latin-1"))
        if clen is not None:
            try:
                n = int(clen)
            except ValueError:
                n = -1
            if n > limit:
                ctx.reason = f"body of {n} bytes is over the {limit}-byte limit"
                await send_json(send, 413, error_body(ctx.reason, "invalid_request_error", 413), [rid_h])
                return "too_large"
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return "cancelled"
            b = msg.get("body", b"")
            if b:
                size += len(b)
                if size > limit:
                    ctx.reason = f"body is over the {limit}-byte limit"
                    await send_json(send, 413, error_body(ctx.reason, "invalid_request_error", 413), [rid_h])
                    return "too_large"
                chunks.append(b)
            if not msg.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            ctx.reason = f"invalid JSON: {e}"
            await send_json(send, 400, error_body(ctx.reason, "invalid_request_error", 400), [rid_h])
            return "bad_request"
        reason = validate_body(body, ctx.endpoint)
        if reason is not None:
            ctx.reason = reason
            await send_json(send, 400, error_body(reason, "invalid_request_error", 400), [rid_h])
            return "bad_request"

        # the PD exchange runs as a task so that a client disconnect can cancel it
        work = asyncio.ensure_future(self._pd(ctx, body, send, rid_h))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            watch.cancel()
            raise
        if work in done:
            watch.cancel()
            return work.result()
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        except Exception:  # the leg failed while being cancelled: the client is gone anyway
            pass
        if ctx.delivered:  # the client closed after reading [DONE]: a complete answer
            return "ok"
        ctx.reason = "client disconnected"
        return "cancelled"

    async def _pd(self, ctx: RequestContext, body: dict[str, Any], send: Send, rid_h: tuple[bytes, bytes]) -> str:
        m = self.metrics
        path = "/v1/chat/completions" if ctx.endpoint == "chat" else "/v1/completions"
        headers = [("content-type", "application/json"), ("x-request-id", ctx.rid)]
        if ctx.auth is not None:
            headers.append(("authorization", ctx.auth.decode("latin-1")))

        # 1. prefill leg (one retry on another worker)
        pre_raw = prefill_body(body)
        key = prompt_key(body, ctx.endpoint == "chat")
        pw = self.prefix.choose(self.prefill, key)
        failures = []
        answer = None
        for attempt in range(2):
            if pw is None:
                break
            ctx.prefill = pw.id
            m.child(m.prefill_dispatch, pw.id).inc()
            try:
                answer = await self._prefill_leg(pw, path, pre_raw, headers)
                break
            except UpstreamError as e:
                m.child(m.upstream_errors, "prefill", pw.id, PREFILL_LABEL.get(e.kind, e.kind)).inc()
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                    # the worker rejected the request itself: retrying elsewhere would not help
                    ctx.reason = f"prefill worker {pw.id} answered {e.status}"
                    await send_bytes(send, e.status, e.body or b"{}", [JSON_HEADER, rid_h])
                    return "bad_request"
                failures.append(f"{pw.id} ({pw.url}): {e.reason}")
                if attempt == 0:
                    pw = self.prefix.choose(self.prefill, key, exclude=pw)
                    if pw is not None:
                        m.child(m.retries, "prefill").inc()
        if answer is None:
            ctx.reason = "prefill failed: " + ("; ".join(failures) or "no prefill worker")
            await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
            return "upstream_error"

        # 2. hand-off: signature -> the decode router's decision, held, reserved, recorded (one dispatcher for the
        # whole request: an admin swap mid-request must not split one request's dispatch and finish)
        ktp = answer.get("kv_transfer_params")
        if not isinstance(ktp, dict):
            ktp = None
        disp = self.dispatch
        h = disp.handoff(ctx.t0, answer, body, ktp)
        try:
            rec = await disp.dispatch(ctx, h)
            dec = dict(body)
            dec["kv_transfer_params"] = ktp
            leg = (path, orjson.dumps(dec), headers, bool(body.get("stream")))
            return await self._decode_legs(ctx, disp, h, rec.decision, leg, send, rid_h)
        finally:
            disp.release(ctx)

    async def _decode_legs(self, ctx: RequestContext, disp: Dispatcher, h: Handoff, choice: Decision,
                           leg: tuple[str, bytes, list[tuple[str, str]], bool], send: Send,
                           rid_h: tuple[bytes, bytes]) -> str:
        """3. decode leg (streamed back as it comes); a connect failure retries once elsewhere. The request is held
        on ``choice.worker``; a retry moves it (:meth:`Dispatcher.retry`)."""
        m = self.metrics
        path, dec_raw, headers, stream = leg
        tried = set()
        while True:
            dw = disp.pool.workers[choice.worker]
            tried.add(dw.id)
            ctx.decode = dw.id
            try:
                return await self._decode_leg(ctx, dw, path, dec_raw, headers, stream, send, rid_h)
            except UpstreamError as e:  # only "connect" leaves the leg: nothing was sent
                m.child(m.upstream_errors, "decode", dw.id, "connect").inc()
                again = disp.retry(ctx, h, tried)
                if again is None:
                    ctx.reason = f"decode worker {dw.id} ({dw.url}) unreachable: {e}"
                    await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
                    return "upstream_error"
                m.child(m.retries, "decode").inc()
                choice = again

    async def _prefill_leg(self, w: Worker, path: str, raw: bytes, headers: list[tuple[str, str]]) -> dict[str, Any]:
        w.inflight += 1
        self.shared.note_change()
        resp = None
        try:
            try:
                async with asyncio.timeout(self.cfg.prefill_timeout_s):
                    resp = await w.pool().request("POST", path, raw, headers)
                    data = await resp.read()
                    status = resp.status
            except TimeoutError:
                raise UpstreamError("timeout", f"no answer within {self.cfg.prefill_timeout_s:g} s") from None
        finally:
            w.inflight -= 1
            self.shared.note_change()
            if resp is not None:
                resp.release()
        if status != 200:
            raise UpstreamError("status", f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}",
                                status=status, body=data)
        try:
            ans = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamError("bad_answer", "prefill answer is not JSON") from None
        if not isinstance(ans, dict):
            raise UpstreamError("bad_answer", "prefill answer is not a JSON object")
        return ans

    async def _decode_leg(self, ctx: RequestContext, w: Worker, path: str, raw: bytes, headers: list[tuple[str, str]],
                          stream: bool, send: Send, rid_h: tuple[bytes, bytes]) -> str:
        m = self.metrics
        rt = self.cfg.decode_read_timeout_s
        resp = None  # w's in-flight count is held by _pd (from the decision on)
        try:
            try:
                resp = await w.pool().request("POST", path, raw, headers, timeout=rt)
            except UpstreamError as e:
                if e.kind == "connect":  # nothing was sent: the caller may retry on another worker
                    raise
                m.child(m.upstream_errors, "decode", w.id, e.kind if e.kind == "timeout" else "connection").inc()
                ctx.reason = f"decode worker {w.id}: {e}"
                await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
                return "upstream_error"
            wid_h = (b"x-eldr-decode-worker", w.id.encode())
            pid_h = (b"x-eldr-prefill-worker", (ctx.prefill or "").encode())
            if resp.status != 200:
                try:
                    data = await resp.read(rt)
                except UpstreamError:
                    data = b""
                m.child(m.upstream_errors, "decode", w.id, "status").inc()
                if 400 <= resp.status < 500:
                    ctx.reason = f"decode worker {w.id} answered {resp.status}"
                    await send_bytes(send, resp.status, data or b"{}", [JSON_HEADER, rid_h, wid_h, pid_h])
                    return "bad_request"
                ctx.reason = f"decode worker {w.id} answered HTTP {resp.status}: " \
                                f"{data[:200].decode('utf-8', 'replace')}"
                await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h, wid_h, pid_h])
                return "upstream_error"
            if not stream:
                try:
                    data = await resp.read(rt)
                except UpstreamError as e:
                    m.child(m.upstream_errors, "decode", w.id, "timeout" if e.kind == "timeout" else "dropped").inc()
                    ctx.reason = f"decode worker {w.id} dropped the answer: {e}"
                    await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h, wid_h, pid_h])
                    return "upstream_error"
                ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
                await send_bytes(send, 200, data, [(b"content-type", ctype), rid_h, wid_h, pid_h])
                return "ok"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [SSE_HEADER, (b"cache-control", b"no-cache"), rid_h, wid_h, pid_h]})
            try:
                async for chunk in resp.iter_chunks(rt):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if chunk.rstrip().endswith(b"data: [DONE]"):
                        # the whole answer is with the client; it may hang up before the upstream ends
                        ctx.delivered = True
            except UpstreamError as e:
                m.child(m.upstream_errors, "decode", w.id, "timeout" if e.kind == "timeout" else "dropped").inc()
                ctx.reason = f"decode worker {w.id} stream ended abnormally: {e}"
                ev = orjson.dumps(error_body(ctx.reason, "upstream_error", 502))
                await send({"type": "http.response.body", "body": b"data: " + ev + b"\n\n", "more_body": False})
                return "stream_error"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "ok"
        finally:
            self.shared.release(ctx)  # its reserved slot (if any) back, whichever leg used it
            if resp is not None:
                resp.release()  # closes the connection unless the answer was read to its end
