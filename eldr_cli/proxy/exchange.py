"""The PD exchange of one client request (vLLM's disaggregated-serving protocol; see eldr_cli.proxy.app):
read and check the body, prefill leg, the handoff decision by the decode router, decode leg streamed back.
Every request carries a typed :class:`RequestContext` and ends in exactly one terminal outcome."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson

from eldr_cli.handoff import SignatureDecodeError, decode_counts, pop_signature
from eldr_cli.proxy.base import AppParts
from eldr_cli.proxy.decisionlog import decision_row, observe_handoff
from eldr_cli.proxy.http import (
    JSON_HEADER,
    SSE_HEADER,
    ConnectFailed,
    Receive,
    Scope,
    Send,
    UpstreamError,
    error_body,
    send_bytes,
    send_json,
    validate_body,
    wait_disconnect,
)
from eldr_cli.proxy.replicas.reserve import reserve_decode
from eldr_cli.proxy.request import RequestContext, context_tokens, prefill_body
from eldr_cli.proxy.upstream import UpstreamHTTPError
from eldr_cli.proxy.workers import Worker
from eldr_cli.routing import Decision, DecodeRouter
from eldr_cli.routing.prefill import prompt_key

log = logging.getLogger("eldr.proxy")

class ExchangeMixin(AppParts):
    """The generate endpoints of :class:`eldr_cli.proxy.app.ProxyApp`."""

    # -- the generate path ----------------------------------------------------------------------
    async def _generate(self, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.state
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
            if self.shadow is not None:
                self.shadow.finish_later(rid)
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
        st, m = self.state, self.metrics
        path = "/v1/chat/completions" if ctx.endpoint == "chat" else "/v1/completions"
        headers = [("content-type", "application/json"), ("x-request-id", ctx.rid)]
        if ctx.auth is not None:
            headers.append(("authorization", ctx.auth.decode("latin-1")))

        # 1. prefill leg (one retry on another worker)
        pre_raw = prefill_body(body)
        key = prompt_key(body, ctx.endpoint == "chat")
        pw = st.prefix.choose(st.prefill, key)
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
                m.child(m.upstream_errors, "prefill", pw.id, e.kind).inc()
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                    # the worker rejected the request itself: retrying elsewhere would not help
                    ctx.reason = f"prefill worker {pw.id} answered {e.status}"
                    await send_bytes(send, e.status, e.body or b"{}", [JSON_HEADER, rid_h])
                    return "bad_request"
                failures.append(f"{pw.id} ({pw.url}): {e.reason}")
                if attempt == 0:
                    pw = st.prefix.choose(st.prefill, key, exclude=pw)
                    if pw is not None:
                        m.child(m.retries, "prefill").inc()
        if answer is None:
            ctx.reason = "prefill failed: " + ("; ".join(failures) or "no prefill worker")
            await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
            return "upstream_error"

        # 2. handoff: signature -> the decode router's decision
        ktp = answer.get("kv_transfer_params")
        if not isinstance(ktp, dict):
            ktp = None
        replay = observe_handoff(self, ctx.t0, answer, body, ktp)  # drift watch; the decision log's replay fields
        counts, sig_state = self._handoff_counts(ktp)
        router = st.router  # an admin swap mid-request must not split one request's dispatch and finish
        tokens = context_tokens(answer, body)
        choice, loads, dt = self._decide(ctx, router, counts, sig_state, tokens)
        self._hold(ctx, router, choice)  # in the live set and the worker's load before anything awaits
        try:
            # replicas: one atomic slot in Redis; a move it makes is one more dispatch (the live set follows)
            choice, ctx.reserved = await reserve_decode(st, choice, loads)
            if choice.worker != ctx.decode_index:
                self._release_hold(ctx, router)
                self._hold(ctx, router, choice)
            self._record(ctx, router, choice, sig_state, loads, dt, (counts, tokens, replay))
            dec = dict(body)
            dec["kv_transfer_params"] = ktp
            leg = (path, orjson.dumps(dec), headers, bool(body.get("stream")))
            return await self._decode_legs(ctx, router, choice, counts, tokens, leg, send, rid_h)
        finally:
            self._release_hold(ctx, router)

    def _hold(self, ctx: RequestContext, router: DecodeRouter, choice: Decision) -> None:
        """The request is on ``choice.worker`` from now on: in the router's live set and in that worker's in-flight
        count (which the next decisions' loads read), whatever awaits follow."""
        router.on_dispatch(choice, ctx.rid)
        w = self.state.decode.workers[choice.worker]
        w.inflight += 1
        ctx.decode_index, ctx.held = choice.worker, w
        self.state.shared.note_change()

    def _release_hold(self, ctx: RequestContext, router: DecodeRouter) -> None:
        """The request left the worker :meth:`_hold` put it on (finished, failed, cancelled or moved)."""
        if ctx.held is None or ctx.decode_index is None:
            return
        router.on_finish(ctx.decode_index, ctx.rid)
        ctx.held.inflight -= 1
        ctx.held, ctx.decode_index = None, None
        self.state.shared.note_change()

    async def _decode_legs(self, ctx: RequestContext, router: DecodeRouter, choice: Decision, counts: Any,
                           tokens: int | None, leg: tuple[str, bytes, list[tuple[str, str]], bool], send: Send,
                           rid_h: tuple[bytes, bytes]) -> str:
        """3. decode leg (streamed back as it comes); a connect failure retries once elsewhere. The request is in
        the router's live set on ``choice.worker``; a retry moves it (finish there, dispatch on the new one)."""
        st, m = self.state, self.metrics
        path, dec_raw, headers, stream = leg
        tried = set()
        while True:
            idx = choice.worker
            dw = st.decode.workers[idx]
            tried.add(dw.id)
            ctx.decode = dw.id
            try:
                return await self._decode_leg(ctx, dw, path, dec_raw, headers, stream, send, rid_h)
            except ConnectFailed as e:
                m.child(m.upstream_errors, "decode", dw.id, "connect").inc()
                # one retry: the same router decides again among the healthy workers not tried yet
                up = [w.healthy and w.id not in tried for w in st.decode.workers]
                if len(tried) >= 2 or not any(up):
                    ctx.reason = f"decode worker {dw.id} ({dw.url}) unreachable: {e}"
                    await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
                    return "upstream_error"
                m.child(m.retries, "decode").inc()
            self._release_hold(ctx, router)  # no await from here to the new dispatch
            choice = router.decide(counts, st.decode.loads(self.cfg.scrape_metrics), domain=ctx.domain,
                                   healthy=up, tokens=tokens)
            self._hold(ctx, router, choice)

    def _handoff_counts(self, ktp: dict[str, Any] | None) -> tuple[Any, str]:
        """The handed-off prefill counts [L, E] (None when missing, malformed or not needed) and their state."""
        enc = pop_signature(ktp)
        if enc is None:
            self.metrics.child(self.metrics.signature_missing, "missing").inc()
            return None, "missing"
        if not self.state.router.needs_signature and self.shadow is None:
            return None, "unused"
        try:
            return decode_counts(enc), "ok"
        except SignatureDecodeError:
            self.metrics.child(self.metrics.signature_missing, "malformed").inc()
            return None, "malformed"

    def _decide(self, ctx: RequestContext, router: DecodeRouter, counts: Any, sig_state: str,
                tokens: int | None) -> tuple[Decision, list[int], float]:
        """The router's decision, the loads it saw and the seconds it took (recorded by :meth:`_record` once the
        reservation has said where the request goes)."""
        st = self.state
        t0 = time.perf_counter()
        loads = st.decode.loads(self.cfg.scrape_metrics)
        d = router.decide(counts, loads, domain=ctx.domain, healthy=[w.healthy for w in st.decode.workers],
                          tokens=tokens)
        return d, loads, time.perf_counter() - t0

    def _record(self, ctx: RequestContext, router: DecodeRouter, d: Decision, sig_state: str, loads: list[int],
                dt: float, request: tuple[Any, int | None, dict[str, Any] | None]) -> None:
        """Metrics and decision log of ``d`` as followed: the worker used, the ranking's first choice beside it."""
        st, m = self.state, self.metrics
        if d.signature == "malformed" and sig_state == "ok":  # decoded, but not of the artifact's shape
            sig_state = "malformed"
            m.child(m.signature_missing, sig_state).inc()
        pname = router.name
        ctx.policy = pname
        m.child(m.decision_seconds, pname).observe(dt)
        if d.band is not None:
            m.band_size.observe(len(d.band))
        workers = st.decode.workers
        wid = workers[d.worker].id
        m.child(m.decisions, pname, wid).inc()
        if d.first != d.worker:
            m.child(m.moved, pname).inc()
        counts, tokens, replay = request
        row = None
        if self.decision_log is not None:
            first = workers[d.first].id if 0 <= d.first < len(workers) else None
            row = decision_row(d, ctx.rid, pname, st.tau_effective(), sig_state, loads, wid, ctx.domain, dt,
                               first) | (replay or {})
        if self.shadow is not None:  # the shadows decide right after this request is dispatched, then log the row
            self.shadow.later(ctx.rid, counts, d, ctx.domain, [w.healthy for w in workers], tokens, row,
                              self.decision_log)
        elif row is not None and self.decision_log is not None:
            self.decision_log.write(row)

    async def _prefill_leg(self, w: Worker, path: str, raw: bytes, headers: list[tuple[str, str]]) -> dict[str, Any]:
        w.inflight += 1
        self.state.shared.note_change()
        resp = None
        try:
            try:
                async with asyncio.timeout(self.cfg.prefill_timeout_s):
                    resp = await w.pool().request("POST", path, raw, headers)
                    data = await resp.read()
                    status = resp.status
            except TimeoutError:
                raise UpstreamError("timeout", f"no answer within {self.cfg.prefill_timeout_s:g} s") from None
            except UpstreamHTTPError as e:
                raise UpstreamError("timeout" if e.kind == "timeout" else "connection", str(e)) from None
        finally:
            w.inflight -= 1
            self.state.shared.note_change()
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
            except UpstreamHTTPError as e:
                if e.kind == "connect":
                    raise ConnectFailed(str(e)) from None
                m.child(m.upstream_errors, "decode", w.id, e.kind if e.kind == "timeout" else "connection").inc()
                ctx.reason = f"decode worker {w.id}: {e}"
                await send_json(send, 502, error_body(ctx.reason, "upstream_error", 502), [rid_h])
                return "upstream_error"
            wid_h = (b"x-eldr-decode-worker", w.id.encode())
            pid_h = (b"x-eldr-prefill-worker", (ctx.prefill or "").encode())
            if resp.status != 200:
                try:
                    data = await resp.read(rt)
                except UpstreamHTTPError:
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
                except UpstreamHTTPError as e:
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
            except UpstreamHTTPError as e:
                m.child(m.upstream_errors, "decode", w.id, "timeout" if e.kind == "timeout" else "dropped").inc()
                ctx.reason = f"decode worker {w.id} stream ended abnormally: {e}"
                ev = orjson.dumps(error_body(ctx.reason, "upstream_error", 502))
                await send({"type": "http.response.body", "body": b"data: " + ev + b"\n\n", "more_body": False})
                return "stream_error"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "ok"
        finally:
            self.state.shared.release(ctx)  # its reserved slot (if any) back, whichever leg used it
            if resp is not None:
                resp.release()  # closes the connection unless the answer was read to its end
