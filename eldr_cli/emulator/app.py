"""The HTTP face of one emulated worker (aiohttp): vLLM's OpenAI endpoints and PD protocol, /health,
/v1/models, /metrics and the decode step log /eldr/steps. The timing lives in
:mod:`eldr_cli.emulator.workers`; response shapes come from :mod:`eldr_cli.openai_shapes`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from eldr_cli import openai_shapes as shapes
from eldr_cli.costmodel.deployment import KV_BLOCK_TOKENS  # fake remote block ids: one per block of prompt
from eldr_cli.emulator.workers import STEP_FIELDS, DecodeRequest, DecodeWorker, PrefillWorker, Worker
from eldr_cli.handoff import SIGNATURE_KEY, encode_counts

PREFILL_TEXT = " the"  # the one token a prefill leg answers with
DECODE_TOKEN = " tok"  # every decoded token
MAX_BODY_BYTES = 8 * 1024 * 1024


def _orjson_dumps(obj) -> str:
    return orjson.dumps(obj).decode()


def _bad_request(message: str) -> web.Response:
    return web.json_response(shapes.error_body(message), status=400)


@dataclass
class _Call:
    """One completion request as the handlers see it."""

    chat: bool
    body: dict
    row: int
    matched: bool
    rid: str
    created: int
    prompt_tokens: int
    model: str

    def shape(self) -> dict:
        return {"rid": self.rid, "model": self.model, "created": self.created, "chat": self.chat}


class WorkerApp:
    """Request handlers bound to one :class:`Worker`; :meth:`build` returns the aiohttp application."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def build(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/eldr/steps", self.steps)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    # -- plain endpoints -------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, _request: web.Request) -> web.Response:
        name = self.worker.model_name
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "eldr-emulator", "root": name}]})

    async def metrics(self, _request: web.Request) -> web.Response:
        w = self.worker
        running, waiting = w.load()
        lines = [f'vllm:num_requests_running{{model_name="{w.model_name}"}} {running}',
                 f'vllm:num_requests_waiting{{model_name="{w.model_name}"}} {waiting}',
                 f"eldr_emulator_requests_total {w.requests_total}",
                 f"eldr_emulator_unmatched_prompts_total {w.unmatched}"]
        if isinstance(w, DecodeWorker):
            lines += [f"eldr_emulator_wrapped_requests_total {w.wrapped}",
                      f'vllm:time_per_output_token_seconds_sum{{model_name="{w.model_name}"}} {w.tpot_s_sum:.6f}',
                      f'vllm:time_per_output_token_seconds_count{{model_name="{w.model_name}"}} {w.tpot_count}']
            if w.kv_blocks:
                lines += [f'vllm:kv_cache_usage_perc{{model_name="{w.model_name}"}} '
                          f"{min(w.kv_used / w.kv_blocks, 1.0):.4f}",
                          f'vllm:num_preemptions_total{{model_name="{w.model_name}"}} {w.preemptions}']
        if isinstance(w, DecodeWorker) and w.steps:
            late = np.array([s[4] for s in w.steps[-2000:]])
            lines += [f"eldr_emulator_decode_steps_total {len(w.steps)}",
                      f'eldr_emulator_step_late_ms{{quantile="0.5"}} {np.median(late):.4f}',
                      f'eldr_emulator_step_late_ms{{quantile="0.99"}} {np.percentile(late, 99):.4f}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def steps(self, request: web.Request) -> web.Response:
        w = self.worker
        if not isinstance(w, DecodeWorker):
            return web.json_response({"worker": w.index, "role": w.role, "steps": {}})
        since = int(request.query.get("since", "0"))
        rows = w.steps[since:]
        cols = {f: [r[i] for r in rows] for i, f in enumerate(STEP_FIELDS)}
        return web.json_response({"worker": w.index, "role": "decode", "since": since,
                                  "next": since + len(rows), "n_layers": w.replay.n_layers,
                                  "requests_total": w.requests_total, "unmatched_total": w.unmatched,
                                  "wrapped_total": w.wrapped,
                                  "num_experts": w.replay.num_experts, "steps": cols}, dumps=_orjson_dumps)

    # -- completions: parse, then a prefill leg or a decode leg ----------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.completions(request, chat=True)

    async def completions(self, request: web.Request, chat: bool = False) -> web.StreamResponse:
        try:
            body = await request.json(loads=orjson.loads)
            if not isinstance(body, dict):
                raise ValueError
        except Exception:
            return _bad_request("body must be a JSON object")
        call = self._accept(body, chat)
        ktp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
        if self.worker.role == "prefill" or (ktp and ktp.get("do_remote_decode")):
            if not isinstance(self.worker, PrefillWorker):
                return _bad_request("this is a decode worker")
            return await self._prefill_leg(call)
        max_tokens = self._max_tokens(call)
        if max_tokens is None:
            return _bad_request("max_tokens must be an integer")
        req = DecodeRequest(call.row, max_tokens, call.matched, call.prompt_tokens)
        assert isinstance(self.worker, DecodeWorker)
        self.worker.submit(req)
        if bool(body.get("stream", False)):
            return await self._stream(request, call, req)
        return await self._collect(call, req)

    def _accept(self, body: dict, chat: bool) -> _Call:
        """Count the request and match its prompt to a trace row."""
        w = self.worker
        w.requests_total += 1
        row, matched = w.match(body, chat)
        return _Call(chat=chat, body=body, row=row, matched=matched, rid=shapes.new_id(chat),
                     created=int(time.time()), prompt_tokens=int(w.replay.prompt_tokens[row]), model=w.model_name)

    async def _prefill_leg(self, call: _Call) -> web.Response:
        """Wait for the prefill step, then answer one token plus the KV handoff and the signature."""
        w = self.worker
        assert isinstance(w, PrefillWorker)
        await w.prefill(call.row)
        n_blocks = max(1, (call.prompt_tokens + KV_BLOCK_TOKENS - 1) // KV_BLOCK_TOKENS)
        out_ktp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": w.engine_id,
                   "remote_block_ids": list(range(n_blocks)), "remote_host": w.host, "remote_port": w.port,
                   "tp_size": 1,
                   SIGNATURE_KEY: encode_counts(w.replay.prefill_counts(call.row), tokens=call.prompt_tokens)}
        ans = shapes.completion_body(**call.shape(), text=PREFILL_TEXT, finish_reason="length",
                                     prompt_tokens=call.prompt_tokens, completion_tokens=1)
        ans["kv_transfer_params"] = out_ktp
        return web.json_response(ans, dumps=_orjson_dumps)

    def _max_tokens(self, call: _Call) -> int | None:
        """The tokens to decode: max_(completion_)tokens, capped (unless ignore_eos) by the trace row's
        captured output length, as the real model would have stopped there. None if not an integer."""
        body = call.body
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        try:
            max_tokens = max(1, int(max_tokens))
        except (TypeError, ValueError):
            return None
        if not body.get("ignore_eos", False):
            cap = int(self.worker.replay.trace.decode_steps[call.row])
            if cap > 0:
                max_tokens = min(max_tokens, cap)
        return max_tokens

    async def _collect(self, call: _Call, req: DecodeRequest) -> web.Response:
        """A non-streaming decode: wait for the last token, answer all of them at once."""
        n = 0
        while True:
            last = await req.queue.get()
            n += 1
            if last:
                break
        return web.json_response(shapes.completion_body(**call.shape(), text=DECODE_TOKEN * n, finish_reason="length",
                                                        prompt_tokens=call.prompt_tokens, completion_tokens=n))

    async def _stream(self, request: web.Request, call: _Call, req: DecodeRequest) -> web.StreamResponse:
        """A streaming decode: one SSE chunk per decode step, the usage chunk if asked, then [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
        n = 0
        try:
            while True:
                last = await req.queue.get()
                n += 1
                await resp.write(shapes.sse(shapes.chunk_body(**call.shape(), text=DECODE_TOKEN, first=n == 1,
                                                              finish_reason="length" if last else None)))
                if last:
                    break
            if include_usage:
                await resp.write(shapes.sse(shapes.usage_chunk_body(**call.shape(), prompt_tokens=call.prompt_tokens,
                                                                    completion_tokens=n)))
            await resp.write(shapes.SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            req.max_tokens = 0  # client went away: finish at the next step
            raise
        return resp


def make_app(worker: Worker) -> web.Application:
    """The aiohttp application serving ``worker``."""
    return WorkerApp(worker).build()
