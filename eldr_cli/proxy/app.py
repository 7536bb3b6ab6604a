"""The proxy as a plain ASGI application (served by uvicorn with httptools + uvloop).

PD flow per request (vLLM's disaggregated-serving protocol, as its NIXL proxy speaks it):

1. prefill leg -> a prefill worker chosen by PrefixHash (least-loaded above 1.25x the average):
   the client's body with ``stream=false``, ``max_tokens=1`` (and ``max_completion_tokens=1`` if
   present), ``min_tokens``/``stream_options`` removed and ``kv_transfer_params`` asking for remote
   decode. Error or timeout: one retry on another prefill worker, then 502 with the reason.
2. handoff: pop ``eldr_signature`` from the returned ``kv_transfer_params`` (eldr_cli.handoff),
   turn it into a signature with ``RoutingModel.signature`` and let the shared policy object from
   ``eldr_cli.stages.routing`` choose the decode worker from the live in-flight loads. A missing or
   malformed signature is routed by JSQ (EldrPolicy's own fallback) and counted, never an error.
3. decode leg -> the chosen decode worker: the client's original body with the returned
   ``kv_transfer_params`` (without ``eldr_signature``; ``null`` passes as ``null``); the answer is
   relayed as is (SSE chunk by chunk when streaming), so usage counts the prompt once.

Every client request ends in exactly one terminal outcome (metrics.OUTCOMES); in-flight counters
are decremented in ``finally`` blocks, and a client disconnect cancels the upstream leg, which
closes the upstream connection (vLLM then aborts the request).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

import orjson

from eldr_cli.errors import EldrError
from eldr_cli.handoff import SignatureDecodeError, decode_counts, pop_signature
from eldr_cli.proxy.config import ProxyConfig
from eldr_cli.proxy.metrics import ProxyMetrics
from eldr_cli.proxy.sharedstate import make_shared_state
from eldr_cli.proxy.upstream import HttpPool, UpstreamHTTPError
from eldr_cli.proxy.workers import DOWN_LOAD, PrefixHashPrefill, Worker, WorkerPool, prompt_key
from eldr_cli.stages.routing import RoutingModel, jsq, make_policy

log = logging.getLogger("eldr.proxy")

PREFILL_KTP = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")


class UpstreamError(Exception):
    def __init__(self, kind: str, reason: str, status: int | None = None, body: bytes | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.status, self.body = kind, reason, status, body


def _err(message: str, type_: str, code: int) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


def validate_body(body, endpoint: str) -> str | None:
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


class ProxyState:
    """Everything one proxy instance knows: pools, policy, routing model, counters."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.prefill = WorkerPool("prefill", cfg.prefill)
        self.decode = WorkerPool("decode", cfg.decode)
        self.model = RoutingModel.load(cfg.routing) if cfg.routing else None
        self.routing_path = cfg.routing
        self.tau_override = cfg.tau
        self.policy_name = cfg.policy
        self.policy = self._make(cfg.policy, len(self.decode), self.model, cfg.tau)
        self.prefix = PrefixHashPrefill(cfg.prefix_block_chars, cfg.prefix_blocks, cfg.prefill_overload_factor)
        self.in_progress = 0
        self.started = 0
        self.shared = make_shared_state(cfg.state)  # local, or counts and changes shared via Redis
        self.outcomes: dict[str, int] = {}

    def _make(self, name, n, model, tau):
        return make_policy(name, n, model=model, tau=tau, seed=self.cfg.seed)

    def tau_effective(self) -> float:
        tau = getattr(self.policy, "tau", None)
        if tau is not None:
            return float(tau)
        if self.tau_override is not None:
            return float(self.tau_override)
        return float(self.model.tau) if self.model is not None else float("nan")


class ProxyApp:
    """ASGI app. ``await app.start()`` / ``await app.stop()`` are run by the ASGI lifespan (or
    lazily on the first request when the server does not send lifespan events)."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.state = ProxyState(cfg)
        self.metrics = ProxyMetrics(self.state)
        self.decision_log = None
        self._started = False
        self._health_task: asyncio.Task | None = None
        self._bg: set[asyncio.Task] = set()

    # -- lifetime -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for w in [*self.state.prefill, *self.state.decode]:
            self._open(w)
        if self.cfg.decision_log:
            from eldr_cli.proxy.decisionlog import DecisionLog

            self.decision_log = DecisionLog(self.cfg.decision_log)
        if self.cfg.health_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        await self.state.shared.start(self)
        log.info("proxy started", extra={"event": "start", "policy": self.state.policy_name,
                                         "prefill": [w.url for w in self.state.prefill],
                                         "decode": [w.url for w in self.state.decode]})

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.state.shared.stop()
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        for t in list(self._bg):
            t.cancel()
        for w in [*self.state.prefill, *self.state.decode]:
            if w.session is not None:
                await w.session.close()
                w.session = None
        if self.decision_log is not None:
            self.decision_log.close()
            self.decision_log = None

    # -- shared state (several replicas) -------------------------------------------------------
    def all_workers(self) -> list[Worker]:
        return [*self.state.prefill, *self.state.decode]

    def apply_remote_change(self, action: str, body: dict) -> None:
        """A run-time change another replica made (and validated) applied here too."""
        m = self.metrics
        if action == "health":
            pool = self.state.prefill if body.get("role") == "prefill" else self.state.decode
            w = pool.find(str(body.get("url", "")))
            if w is not None and w.healthy != bool(body.get("healthy")):
                w.healthy = bool(body.get("healthy"))
                w.fail_streak = w.ok_streak = 0
                to = "up" if w.healthy else "down"
                m.child(m.health_transitions, w.role, w.id, to).inc()
                log.warning(f"worker {to} (seen by another replica)",
                            extra={"event": "health", "worker": w.id, "url": w.url, "to": to, "remote": True})
            return
        handler = {"policy": self._admin_policy, "workers": self._admin_workers,
                   "reload": self._admin_reload}.get(action)
        if handler is None:
            return
        try:
            handler(body)
        except _Refused as e:  # same config on every replica: only a diverged replica gets here
            m.child(m.admin_actions, action, "remote_refused").inc()
            log.error("a change made on another replica was refused here", extra={
                "event": "admin", "action": action, "reason": str(e), "remote": True})
            return
        m.child(m.admin_actions, action, "remote_ok").inc()
        log.info("admin (from another replica)", extra={"event": "admin", "action": action, "body": body,
                                                         "remote": True})

    def _open(self, w: Worker) -> None:
        # one keep-alive pool per upstream worker
        w.session = HttpPool(w.url, connect_timeout=self.cfg.connect_timeout_s,
                             max_idle=self.cfg.max_connections_per_worker)

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _close_when_drained(self, w: Worker) -> None:
        while w.inflight > 0:
            await asyncio.sleep(0.2)
        if w.session is not None:
            await w.session.close()
            w.session = None

    # -- ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        typ = scope["type"]
        if typ == "http":
            if not self._started:
                await self.start()
            path, method = scope["path"], scope["method"]
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None and method == "POST":
                return await self._generate(endpoint, scope, receive, send)
            if method == "GET":
                if path == "/health":
                    return await self._health(send)
                if path == "/metrics":
                    return await _send(send, 200, self.metrics.render(),
                                       [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
                if path == "/v1/models":
                    return await self._models(send)
                if path == "/admin/workers":
                    return await self._admin(path, method, scope, receive, send)
            if path.startswith("/admin/") and method == "POST":
                return await self._admin(path, method, scope, receive, send)
            if endpoint is not None or path in ("/health", "/metrics", "/v1/models"):
                return await _send_json(send, 405, _err(f"method {method} not allowed on {path}",
                                                        "invalid_request_error", 405))
            return await _send_json(send, 404, _err(f"no route {path}", "not_found_error", 404))
        if typ == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.start()
                    except Exception as e:  # surface as a failed startup, not a hang
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # -- the generate path ----------------------------------------------------------------------
    async def _generate(self, endpoint, scope, receive, send):
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
        ctx = {"rid": rid, "endpoint": endpoint, "domain": domain, "auth": auth, "t0": time.perf_counter()}
        outcome = "cancelled"
        try:
            outcome = await self._generate_inner(ctx, clen, receive, send)
        finally:
            st.outcomes[outcome] = st.outcomes.get(outcome, 0) + 1
            self.metrics.child(self.metrics.requests, endpoint, outcome).inc()
            st.in_progress -= 1  # last: tests in other threads wait for 0, then read the outcome
            if log.isEnabledFor(logging.INFO):
                log.info("request", extra={"event": "request", "request_id": rid, "endpoint": endpoint,
                                           "outcome": outcome, "prefill": ctx.get("prefill"),
                                           "decode": ctx.get("decode"), "policy": ctx.get("policy"),
                                           "reason": ctx.get("reason"),
                                           "ms": round((time.perf_counter() - ctx["t0"]) * 1e3, 3)})

    async def _generate_inner(self, ctx, clen, receive, send) -> str:
        limit = self.cfg.max_body_bytes
        rid_h = (b"x-request-id", ctx["rid"].encode("latin-1"))
        if clen is not None:
            try:
                n = int(clen)
            except ValueError:
                n = -1
            if n > limit:
                ctx["reason"] = f"body of {n} bytes is over the {limit}-byte limit"
                await _send_json(send, 413, _err(ctx["reason"], "invalid_request_error", 413), [rid_h])
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
                    ctx["reason"] = f"body is over the {limit}-byte limit"
                    await _send_json(send, 413, _err(ctx["reason"], "invalid_request_error", 413), [rid_h])
                    return "too_large"
                chunks.append(b)
            if not msg.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            ctx["reason"] = f"invalid JSON: {e}"
            await _send_json(send, 400, _err(ctx["reason"], "invalid_request_error", 400), [rid_h])
            return "bad_request"
        reason = validate_body(body, ctx["endpoint"])
        if reason is not None:
            ctx["reason"] = reason
            await _send_json(send, 400, _err(reason, "invalid_request_error", 400), [rid_h])
            return "bad_request"

        # the PD exchange runs as a task so that a client disconnect can cancel it
        work = asyncio.ensure_future(self._pd(ctx, body, send, rid_h))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
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
        if ctx.get("delivered"):  # the client closed after reading [DONE]: a complete answer
            return "ok"
        ctx["reason"] = "client disconnected"
        return "cancelled"

    async def _pd(self, ctx, body, send, rid_h) -> str:
        st, m = self.state, self.metrics
        path = "/v1/chat/completions" if ctx["endpoint"] == "chat" else "/v1/completions"
        headers = [("content-type", "application/json"), ("x-request-id", ctx["rid"])]
        if ctx["auth"] is not None:
            headers.append(("authorization", ctx["auth"].decode("latin-1")))

        # 1. prefill leg (one retry on another worker)
        pre = dict(body)
        pre["stream"] = False
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("min_tokens", None)
        pre.pop("stream_options", None)
        pre["kv_transfer_params"] = dict(PREFILL_KTP)
        pre_raw = orjson.dumps(pre)
        key = prompt_key(body, ctx["endpoint"] == "chat")
        pw = st.prefix.choose(st.prefill, key)
        failures = []
        answer = None
        for attempt in range(2):
            if pw is None:
                break
            ctx["prefill"] = pw.id
            m.child(m.prefill_dispatch, pw.id).inc()
            try:
                answer = await self._prefill_leg(pw, path, pre_raw, headers)
                break
            except UpstreamError as e:
                m.child(m.upstream_errors, "prefill", pw.id, e.kind).inc()
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                    # the worker rejected the request itself: retrying elsewhere would not help
                    ctx["reason"] = f"prefill worker {pw.id} answered {e.status}"
                    await _send(send, e.status, e.body or b"{}", [_JSON, rid_h])
                    return "bad_request"
                failures.append(f"{pw.id} ({pw.url}): {e.reason}")
                if attempt == 0:
                    pw = st.prefix.choose(st.prefill, key, exclude=pw)
                    if pw is not None:
                        m.child(m.retries, "prefill").inc()
        if answer is None:
            ctx["reason"] = "prefill failed: " + ("; ".join(failures) or "no prefill worker")
            await _send_json(send, 502, _err(ctx["reason"], "upstream_error", 502), [rid_h])
            return "upstream_error"

        # 2. handoff: signature -> shared policy decision
        ktp = answer.get("kv_transfer_params")
        if not isinstance(ktp, dict):
            ktp = None
        idx, loads = self._decide(ctx, ktp)

        # 3. decode leg (streamed back as it comes); a connect failure retries once elsewhere
        dec = dict(body)
        dec["kv_transfer_params"] = ktp
        dec_raw = orjson.dumps(dec)
        stream = bool(body.get("stream"))
        tried = set()
        while True:
            dw = st.decode.workers[idx]
            tried.add(dw.id)
            ctx["decode"] = dw.id
            try:
                return await self._decode_leg(ctx, dw, path, dec_raw, headers, stream, send, rid_h)
            except _ConnectFailed as e:
                m.child(m.upstream_errors, "decode", dw.id, "connect").inc()
                loads = [DOWN_LOAD if w.id in tried else l for w, l in zip(st.decode.workers, loads)]
                nxt = jsq(loads)
                if st.decode.workers[nxt].id in tried or len(tried) >= 2:
                    ctx["reason"] = f"decode worker {dw.id} ({dw.url}) unreachable: {e}"
                    await _send_json(send, 502, _err(ctx["reason"], "upstream_error", 502), [rid_h])
                    return "upstream_error"
                m.child(m.retries, "decode").inc()
                idx = nxt

    def _decide(self, ctx, ktp):
        st, m = self.state, self.metrics
        t0 = time.perf_counter()
        policy = st.policy
        enc = pop_signature(ktp)
        signature = None
        sig_state = "ok"
        if enc is None:
            sig_state = "missing"
        elif policy.needs_signature:
            try:
                signature = st.model.signature(decode_counts(enc))
            except (SignatureDecodeError, EldrError):
                sig_state = "malformed"
        if sig_state != "ok":
            m.child(m.signature_missing, sig_state).inc()
        loads = st.decode.loads(self.cfg.scrape_metrics)
        idx = policy.choose(loads, signature=signature, domain=ctx["domain"],
                            healthy=[w.healthy for w in st.decode.workers])
        dt = time.perf_counter() - t0
        pname = st.policy_name
        ctx["policy"] = pname
        m.child(m.decision_seconds, pname).observe(dt)
        last = getattr(policy, "last", None) if signature is not None else None
        if last is not None:
            m.band_size.observe(len(last.band))
        wid = st.decode.workers[idx].id
        m.child(m.decisions, pname, wid).inc()
        if self.decision_log is not None:
            self.decision_log.write({
                "ts": time.time(), "request_id": ctx["rid"], "policy": pname, "tau": st.tau_effective(),
                "signature": sig_state if policy.needs_signature or enc is None else "unused",
                "similarities": None if last is None else last.similarities.tolist(),
                "band": None if last is None else last.band.tolist(),
                "loads": [int(x) for x in loads], "chosen": int(idx), "worker": wid,
                "domain": ctx["domain"], "decision_us": round(dt * 1e6, 2)})
        return idx, loads

    async def _prefill_leg(self, w: Worker, path, raw, headers) -> dict:
        w.inflight += 1
        resp = None
        try:
            try:
                async with asyncio.timeout(self.cfg.prefill_timeout_s):
                    resp = await w.session.request("POST", path, raw, headers)
                    data = await resp.read()
                    status = resp.status
            except TimeoutError:
                raise UpstreamError("timeout", f"no answer within {self.cfg.prefill_timeout_s:g} s") from None
            except UpstreamHTTPError as e:
                raise UpstreamError("timeout" if e.kind == "timeout" else "connection", str(e)) from None
        finally:
            w.inflight -= 1
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

    async def _decode_leg(self, ctx, w: Worker, path, raw, headers, stream, send, rid_h) -> str:
        m = self.metrics
        rt = self.cfg.decode_read_timeout_s
        w.inflight += 1
        resp = None
        try:
            try:
                resp = await w.session.request("POST", path, raw, headers, timeout=rt)
            except UpstreamHTTPError as e:
                if e.kind == "connect":
                    raise _ConnectFailed(str(e)) from None
                m.child(m.upstream_errors, "decode", w.id, e.kind if e.kind == "timeout" else "connection").inc()
                ctx["reason"] = f"decode worker {w.id}: {e}"
                await _send_json(send, 502, _err(ctx["reason"], "upstream_error", 502), [rid_h])
                return "upstream_error"
            wid_h = (b"x-eldr-decode-worker", w.id.encode())
            pid_h = (b"x-eldr-prefill-worker", ctx["prefill"].encode())
            if resp.status != 200:
                try:
                    data = await resp.read(rt)
                except UpstreamHTTPError:
                    data = b""
                m.child(m.upstream_errors, "decode", w.id, "status").inc()
                if 400 <= resp.status < 500:
                    ctx["reason"] = f"decode worker {w.id} answered {resp.status}"
                    await _send(send, resp.status, data or b"{}", [_JSON, rid_h, wid_h, pid_h])
                    return "bad_request"
                ctx["reason"] = f"decode worker {w.id} answered HTTP {resp.status}: " \
                                f"{data[:200].decode('utf-8', 'replace')}"
                await _send_json(send, 502, _err(ctx["reason"], "upstream_error", 502), [rid_h, wid_h, pid_h])
                return "upstream_error"
            if not stream:
                try:
                    data = await resp.read(rt)
                except UpstreamHTTPError as e:
                    m.child(m.upstream_errors, "decode", w.id, "timeout" if e.kind == "timeout" else "dropped").inc()
                    ctx["reason"] = f"decode worker {w.id} dropped the answer: {e}"
                    await _send_json(send, 502, _err(ctx["reason"], "upstream_error", 502), [rid_h, wid_h, pid_h])
                    return "upstream_error"
                ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
                await _send(send, 200, data, [(b"content-type", ctype), rid_h, wid_h, pid_h])
                return "ok"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [_SSE, (b"cache-control", b"no-cache"), rid_h, wid_h, pid_h]})
            try:
                async for chunk in resp.iter_chunks(rt):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if chunk.rstrip().endswith(b"data: [DONE]"):
                        # the whole answer is with the client; it may hang up before the upstream ends
                        ctx["delivered"] = True
            except UpstreamHTTPError as e:
                m.child(m.upstream_errors, "decode", w.id, "timeout" if e.kind == "timeout" else "dropped").inc()
                ctx["reason"] = f"decode worker {w.id} stream ended abnormally: {e}"
                ev = orjson.dumps(_err(ctx["reason"], "upstream_error", 502))
                await send({"type": "http.response.body", "body": b"data: " + ev + b"\n\n", "more_body": False})
                return "stream_error"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "ok"
        finally:
            w.inflight -= 1
            if resp is not None:
                resp.release()  # closes the connection unless the answer was read to its end

    # -- other endpoints ------------------------------------------------------------------------
    async def _health(self, send):
        st = self.state
        p_up, d_up = len(st.prefill.healthy()), len(st.decode.healthy())
        ok = p_up > 0 and d_up > 0
        body = {"status": "ok" if ok else "unavailable", "policy": st.policy_name, "tau": st.tau_effective(),
                "routing": st.routing_path, "prefill_up": p_up, "decode_up": d_up,
                "in_progress": st.in_progress, "state": st.shared.kind, "replica": st.shared.replica_id,
                "replicas": st.shared.live_replicas,
                "workers": [w.as_dict() for w in [*st.prefill, *st.decode]]}
        await _send_json(send, 200 if ok else 503, body)

    async def _models(self, send):
        st = self.state
        errs = []
        for w in [*st.decode.healthy(), *st.prefill.healthy()]:
            try:
                status, data = await _get(w, "/v1/models", 10.0)
                if status == 200:
                    return await _send(send, 200, data, [_JSON])
                errs.append(f"{w.id}: HTTP {status}")
            except (UpstreamHTTPError, TimeoutError) as e:
                errs.append(f"{w.id}: {e or type(e).__name__}")
        await _send_json(send, 502, _err("no worker answered /v1/models: " + "; ".join(errs), "upstream_error", 502))

    # -- admin ----------------------------------------------------------------------------------
    async def _admin(self, path, method, scope, receive, send):
        m = self.metrics
        action = path.rsplit("/", 1)[-1]
        if action not in ("policy", "workers", "reload"):
            action = "other"  # bounded label values: the path is client-controlled
        token = self.cfg.admin_token
        if not token:
            m.child(m.admin_actions, action, "disabled").inc()
            return await _send_json(send, 403, _err("admin endpoints are disabled; start the proxy with "
                                                    "--admin-token or ELDR_ADMIN_TOKEN", "permission_error", 403))
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(auth, b"Bearer " + token.encode()):
            m.child(m.admin_actions, action, "unauthorized").inc()
            return await _send_json(send, 401, _err("missing or wrong bearer token", "authentication_error", 401),
                                    [(b"www-authenticate", b"Bearer")])
        if method == "GET":
            return await _send_json(send, 200, self._pools())
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if len(raw) > 1 << 20:
                return await _send_json(send, 413, _err("admin body too large", "invalid_request_error", 413))
            if not msg.get("more_body", False):
                break
        try:
            body = orjson.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            m.child(m.admin_actions, action, "bad_request").inc()
            return await _send_json(send, 400, _err(f"invalid JSON: {e}", "invalid_request_error", 400))
        handler = {"policy": self._admin_policy, "workers": self._admin_workers, "reload": self._admin_reload}.get(action)
        if handler is None:
            return await _send_json(send, 404, _err(f"no admin action {action!r}", "not_found_error", 404))
        try:
            result = handler(body)
        except _Refused as e:
            m.child(m.admin_actions, action, "refused").inc()
            log.warning("admin refused", extra={"event": "admin", "action": action, "reason": str(e)})
            return await _send_json(send, e.status, _err(str(e), "invalid_request_error", e.status))
        m.child(m.admin_actions, action, "ok").inc()
        log.info("admin", extra={"event": "admin", "action": action, "body": body})
        self.state.shared.publish_change(action, body)  # validated and applied here: every replica follows
        return await _send_json(send, 200, result)

    def _pools(self) -> dict:
        st = self.state
        return {"policy": st.policy_name, "tau": st.tau_effective(), "routing": st.routing_path,
                "k": None if st.model is None else st.model.n_clusters,
                "prefill": [w.as_dict() for w in st.prefill], "decode": [w.as_dict() for w in st.decode]}

    def _admin_policy(self, body) -> dict:
        st = self.state
        name = body.get("policy", st.policy_name)
        tau = body.get("tau", st.tau_override)
        if tau is not None and (not isinstance(tau, (int, float)) or isinstance(tau, bool) or not 0 <= tau <= 2):
            raise _Refused(f"tau must be a number in [0, 2], got {tau!r}")
        try:
            policy = st._make(name, len(st.decode), st.model, tau)
        except EldrError as e:
            raise _Refused(str(e)) from None
        st.policy, st.policy_name, st.tau_override = policy, name, tau
        return self._pools()

    def _admin_workers(self, body) -> dict:
        st = self.state
        action, role, url = body.get("action"), body.get("role"), body.get("url")
        if action not in ("add", "remove") or role not in ("prefill", "decode") or not isinstance(url, str) \
                or not url.startswith("http://"):
            raise _Refused('expected {"action": "add"|"remove", "role": "prefill"|"decode", "url": "http://..."}')
        pool = st.prefill if role == "prefill" else st.decode
        n_new = len(pool) + (1 if action == "add" else -1)
        if n_new < 1:
            raise _Refused(f"refusing to remove the last {role} worker")
        if role == "decode":
            if st.policy_name == "eldr" and st.model is not None and st.model.n_clusters != n_new:
                raise _Refused(
                    f"the routing artifact has K={st.model.n_clusters} centroids, the decode pool would have "
                    f"{n_new} workers; send POST /admin/reload {{\"routing\": DIR, \"decode\": [...]}} with an "
                    f"artifact fitted for K={n_new} (or switch policy first)", status=409)
        try:
            if action == "add":
                w = pool.add(url)
                self._open(w)
            else:
                w = pool.remove(url)
                self._spawn(self._close_when_drained(w))
        except ValueError as e:
            raise _Refused(str(e), status=409) from None
        if role == "decode":
            st.policy = st._make(st.policy_name, len(st.decode), st.model, st.tau_override)
        return self._pools()

    def _admin_reload(self, body) -> dict:
        st = self.state
        path = body.get("routing")
        if not isinstance(path, str):
            raise _Refused('expected {"routing": "DIR"} (optionally "decode": [urls] to swap the pool at once)')
        try:
            model = RoutingModel.load(path)
        except EldrError as e:
            raise _Refused(f"cannot load routing artifact {path}: {e}") from None
        new_urls = body.get("decode")
        if new_urls is not None:
            if not isinstance(new_urls, list) or not new_urls or not all(
                    isinstance(u, str) and u.startswith("http://") for u in new_urls):
                raise _Refused('"decode" must be a non-empty list of http:// URLs')
            n = len({u.rstrip("/") for u in new_urls})
        else:
            n = len(st.decode)
        if model.n_clusters != n:
            raise _Refused(f"routing artifact {path} has K={model.n_clusters} centroids but the decode pool has "
                           f"{n} workers; refit with `eldr fit --decoders {n}` or pass the matching pool "
                           f"in \"decode\"", status=409)
        try:
            policy = st._make(st.policy_name, n, model, st.tau_override)
        except EldrError as e:
            raise _Refused(str(e)) from None
        if new_urls is not None:  # swap the decode pool: keep workers that stay, open new, drain removed
            keep = {u.rstrip("/") for u in new_urls}
            for w in list(st.decode):
                if w.url not in keep:
                    st.decode.remove(w.url)
                    self._spawn(self._close_when_drained(w))
            have = {w.url: w for w in st.decode}
            ordered = []
            for u in new_urls:
                u = u.rstrip("/")
                if u in have:
                    ordered.append(have[u])
                elif u not in {w.url for w in ordered}:
                    w = st.decode.add(u)
                    st.decode.workers.remove(w)
                    self._open(w)
                    ordered.append(w)
            st.decode.workers = ordered
        st.model, st.routing_path, st.policy = model, path, policy
        return self._pools()

    # -- health checks and load scraping --------------------------------------------------------
    async def _health_loop(self):
        while True:
            try:
                await self.check_health_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the checker die
                log.exception("health check round failed")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def check_health_once(self) -> None:
        ws = [w for w in [*self.state.prefill, *self.state.decode] if w.session is not None]
        await asyncio.gather(*(self._check(w) for w in ws))

    async def _check(self, w: Worker) -> None:
        cfg = self.cfg
        ok = False
        try:
            status, _ = await _get(w, cfg.health_path, cfg.health_timeout_s)
            ok = status == 200
            if ok and cfg.scrape_metrics and w.role == "decode":
                status, data = await _get(w, "/metrics", cfg.health_timeout_s)
                w.scraped_running = parse_running(data.decode("utf-8", "replace")) if status == 200 else None
        except (UpstreamHTTPError, TimeoutError, ValueError):
            pass  # a failed scrape after a good /health still counts the worker as up
        if ok:
            w.fail_streak, w.ok_streak = 0, w.ok_streak + 1
            if not w.healthy and w.ok_streak >= cfg.health_success_threshold:
                w.healthy = True
                self.state.shared.publish_change("health", {"role": w.role, "url": w.url, "healthy": True})
                self.metrics.child(self.metrics.health_transitions, w.role, w.id, "up").inc()
                log.warning("worker up", extra={"event": "health", "worker": w.id, "url": w.url, "to": "up"})
        else:
            w.ok_streak, w.fail_streak = 0, w.fail_streak + 1
            w.scraped_running = None
            if w.healthy and w.fail_streak >= cfg.health_fail_threshold:
                w.healthy = False
                self.state.shared.publish_change("health", {"role": w.role, "url": w.url, "healthy": False})
                self.metrics.child(self.metrics.health_transitions, w.role, w.id, "down").inc()
                log.warning("worker down", extra={"event": "health", "worker": w.id, "url": w.url, "to": "down"})


def parse_running(text: str) -> int | None:
    """Sum of ``vllm:num_requests_running`` samples in a Prometheus text page (None if absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return int(total) if seen else None


class _ConnectFailed(Exception):
    pass


class _Refused(Exception):
    def __init__(self, msg, status=400):
        super().__init__(msg)
        self.status = status


async def _get(w: Worker, path: str, timeout: float) -> tuple[int, bytes]:
    resp = None
    try:
        async with asyncio.timeout(timeout):
            resp = await w.session.request("GET", path)
            return resp.status, await resp.read()
    finally:
        if resp is not None:
            resp.release()


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _send(send, status: int, body: bytes, headers) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, obj, headers=()) -> None:
    await _send(send, status, orjson.dumps(obj), [_JSON, *headers])


def create_app(config: ProxyConfig | None = None, **kwargs) -> ProxyApp:
    """The app factory: ``create_app(ProxyConfig(...))`` or ``create_app(prefill=[...], decode=[...], ...)``."""
    cfg = config if config is not None else ProxyConfig(**kwargs)
    return ProxyApp(cfg.validate())
