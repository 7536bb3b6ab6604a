"""An emulated xPyD cluster (`eldr emulate`): prefill and decode workers that speak vLLM's HTTP and PD
protocol, with step times from a measured cost model and expert unions from replayed trace picks.

**One asyncio process serving every worker on its own port** (not one process per worker): the
workers compute nothing heavy -- a step is one bitwise OR over the batch's replayed expert sets
(tens of microseconds) followed by a sleep until the step's deadline -- so 24 processes would only add
context switches on a 2-core machine, while one uvloop loop keeps every timer within a fraction of a
millisecond. Timing honesty is measured, not assumed: every decode step records how late its end
was against its deadline (``late_ms`` in the step log, ``eldr_emulator_step_late_ms`` in /metrics),
and the simulator (which has no event loop at all) reproduces the emulated median TPOT within 10%
(tests/test_bench_emulator.py). Steps are scheduled by absolute deadlines, so lateness never accumulates.

Protocol (vLLM NIXL-proxy style):
- POST /v1/completions and /v1/chat/completions, streaming (SSE, ``stream_options.include_usage``)
  or not; ``max_tokens``/``max_completion_tokens``; ``ignore_eos`` (without it a request stops at its
  trace row's captured output length);
- a prefill request carries ``kv_transfer_params.do_remote_decode = true``; the answer carries a
  top-level ``kv_transfer_params`` with ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port`` and ``eldr_signature`` =
  ``handoff.encode_counts(prefill counts of the matched trace row)``, as the vLLM plugin returns;
- a decode request carries the prefill's ``kv_transfer_params`` (``do_remote_prefill = true``) and joins
  the worker's continuous batch; a request without transferred KV is decoded the same way (the
  emulator does not charge a prompt recompute);
- GET /health, /v1/models, /metrics (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``eldr_emulator_*``), /eldr/steps?since=N (the decode step log: batch, active experts, step ms).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque

import numpy as np
import orjson

from eldr_cli.bench.replay import TraceReplay, prefill_batch, prompt_of

STEP_FIELDS = ("t_s", "batch", "active_experts", "step_ms", "late_ms")
CATCH_UP_S = 0.05  # a step that ended up to 50 ms late is made up by the following steps


class _Req:
    __slots__ = ("row", "max_tokens", "ntok", "queue", "matched", "prompt_tokens", "arrived")

    def __init__(self, row, max_tokens, matched, prompt_tokens):
        self.row = row
        self.max_tokens = max_tokens
        self.ntok = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.matched = matched
        self.prompt_tokens = prompt_tokens
        self.arrived = time.perf_counter()


async def _sleep_until(deadline: float) -> None:
    d = deadline - time.perf_counter()
    if d > 0.0015:
        await asyncio.sleep(d - 0.0008)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


class Worker:
    """State shared by both roles."""

    def __init__(self, role: str, index: int, replay: TraceReplay, model_name: str, host: str, port: int):
        self.role, self.index, self.replay = role, index, replay
        self.model_name, self.host, self.port = model_name, host, port
        self.engine_id = f"eldr-emu-{role[0]}{index}-{uuid.uuid4().hex[:6]}"
        self.unmatched = 0
        self.requests_total = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def match(self, body: dict, chat: bool) -> tuple[int, bool]:
        row, ok = self.replay.match(prompt_of(body, chat))
        if not ok:
            self.unmatched += 1
        return row, ok

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


class PrefillWorker(Worker):
    def __init__(self, *a, max_batched_tokens: int = 8192, **kw):
        super().__init__("prefill", *a, **kw)
        self.pending: deque = deque()
        self.max_batched_tokens = max_batched_tokens
        self.running = 0

    async def prefill(self, row: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((row, fut))
        self._wake.set()
        await fut

    async def _loop(self) -> None:
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            toks = [int(self.replay.prompt_tokens[r]) for r, _ in itertools.islice(self.pending, 64)]
            k = prefill_batch(toks, self.max_batched_tokens)
            batch = [self.pending.popleft() for _ in range(k)]
            self.running = k
            ms, _ = self.replay.prefill_step_ms(np.array([r for r, _ in batch]))
            await _sleep_until(time.perf_counter() + max(ms, 0.01) / 1e3)
            self.running = 0
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)


class DecodeWorker(Worker):
    def __init__(self, *a, max_seqs: int = 256, **kw):
        super().__init__("decode", *a, **kw)
        self.max_seqs = max_seqs
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.steps: list[tuple] = []
        self.t0 = time.perf_counter()

    def submit(self, req: _Req) -> None:
        self.waiting.append(req)
        self._wake.set()

    async def _loop(self) -> None:
        replay = self.replay
        last_deadline = None
        while True:
            while self.waiting and len(self.running) < self.max_seqs:
                self.running.append(self.waiting.popleft())
            if not self.running:
                last_deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.perf_counter()
            # back-to-back steps chain on the previous deadline, so a late wake-up (a busy host) is made
            # up by the next step instead of stretching every token gap; lateness is still logged
            start = last_deadline if last_deadline is not None and now - last_deadline < CATCH_UP_S else now
            run = self.running
            rows = np.fromiter((r.row for r in run), dtype=np.int64, count=len(run))
            done = np.fromiter((r.ntok for r in run), dtype=np.int64, count=len(run))
            ms, active = replay.decode_step_ms(rows, done)
            ms = max(ms, 0.01)
            deadline = start + ms / 1e3
            last_deadline = deadline
            await _sleep_until(deadline)
            end = time.perf_counter()
            self.steps.append((start - self.t0, len(run), active, ms, (end - deadline) * 1e3))
            keep = []
            for r in run:
                r.ntok += 1
                last = r.ntok >= r.max_tokens
                r.queue.put_nowait(last)
                if not last:
                    keep.append(r)
            self.running = keep


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def make_app(worker: Worker):
    from aiohttp import web

    from eldr_cli.handoff import SIGNATURE_KEY, encode_counts

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        return web.json_response({"object": "list", "data": [
            {"id": worker.model_name, "object": "model", "owned_by": "eldr-emulator", "root": worker.model_name}]})

    async def metrics(_):
        running = worker.running if isinstance(worker, PrefillWorker) else len(worker.running)
        waiting = len(worker.pending) if isinstance(worker, PrefillWorker) else len(worker.waiting)
        lines = [f'vllm:num_requests_running{{model_name="{worker.model_name}"}} {running}',
                 f'vllm:num_requests_waiting{{model_name="{worker.model_name}"}} {waiting}',
                 f"eldr_emulator_requests_total {worker.requests_total}",
                 f"eldr_emulator_unmatched_prompts_total {worker.unmatched}"]
        if isinstance(worker, DecodeWorker) and worker.steps:
            late = np.array([s[4] for s in worker.steps[-2000:]])
            lines += [f"eldr_emulator_decode_steps_total {len(worker.steps)}",
                      f'eldr_emulator_step_late_ms{{quantile="0.5"}} {np.median(late):.4f}',
                      f'eldr_emulator_step_late_ms{{quantile="0.99"}} {np.percentile(late, 99):.4f}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def steps(request):
        if not isinstance(worker, DecodeWorker):
            return web.json_response({"worker": worker.index, "role": worker.role, "steps": {}})
        since = int(request.query.get("since", "0"))
        rows = worker.steps[since:]
        cols = {f: [r[i] for r in rows] for i, f in enumerate(STEP_FIELDS)}
        return web.json_response({"worker": worker.index, "role": "decode", "since": since,
                                  "next": since + len(rows), "n_layers": worker.replay.n_layers,
                                  "num_experts": worker.replay.num_experts, "steps": cols},
                                 dumps=lambda o: orjson.dumps(o).decode())

    async def completions(request, chat: bool = False):
        try:
            body = await request.json(loads=orjson.loads)
            if not isinstance(body, dict):
                raise ValueError
        except Exception:
            return web.json_response({"error": {"message": "body must be a JSON object", "type": "BadRequest"}},
                                     status=400)
        worker.requests_total += 1
        row, matched = worker.match(body, chat)
        ktp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        prompt_tokens = int(worker.replay.prompt_tokens[row])
        if worker.role == "prefill" or (ktp and ktp.get("do_remote_decode")):
            if worker.role != "prefill":
                return web.json_response({"error": {"message": "this is a decode worker", "type": "BadRequest"}},
                                         status=400)
            await worker.prefill(row)
            out_ktp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": worker.engine_id,
                       "remote_block_ids": list(range(max(1, (prompt_tokens + 15) // 16))),
                       "remote_host": worker.host, "remote_port": worker.port, "tp_size": 1,
                       SIGNATURE_KEY: encode_counts(worker.replay.prefill_counts(row), tokens=prompt_tokens)}
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": " the"}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": " the", "logprobs": None, "finish_reason": "length"}
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": worker.model_name, "choices": [choice],
                                      "usage": usage, "kv_transfer_params": out_ktp},
                                     dumps=lambda o: orjson.dumps(o).decode())
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        try:
            max_tokens = max(1, int(max_tokens))
        except (TypeError, ValueError):
            return web.json_response({"error": {"message": "max_tokens must be an integer", "type": "BadRequest"}},
                                     status=400)
        if not body.get("ignore_eos", False):
            cap = int(worker.replay.trace.decode_steps[row])
            if cap > 0:
                max_tokens = min(max_tokens, cap)
        req = _Req(row, max_tokens, matched, prompt_tokens)
        worker.submit(req)
        stream = bool(body.get("stream", False))
        obj = "chat.completion.chunk" if chat else "text_completion"
        if not stream:
            n = 0
            while True:
                last = await req.queue.get()
                n += 1
                if last:
                    break
            text = " tok" * n
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": worker.model_name, "choices": [choice],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                "total_tokens": prompt_tokens + n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n = 0
        try:
            while True:
                last = await req.queue.get()
                n += 1
                if chat:
                    delta = {"content": " tok"} if n > 1 else {"role": "assistant", "content": " tok"}
                    choice = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": "length" if last else None}
                else:
                    choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length" if last else None,
                              "stop_reason": None}
                await resp.write(_sse({"id": rid, "object": obj, "created": created, "model": worker.model_name,
                                       "choices": [choice]}))
                if last:
                    break
            if include_usage:
                await resp.write(_sse({"id": rid, "object": obj, "created": created, "model": worker.model_name,
                                       "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                                "completion_tokens": n,
                                                                "total_tokens": prompt_tokens + n}}))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            req.max_tokens = 0  # client went away: finish at the next step
            raise
        return resp

    async def chat_completions(request):
        return await completions(request, chat=True)

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/eldr/steps", steps)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


class EmulatedCluster:
    """P prefill + D decode workers on consecutive ports of one event loop."""

    def __init__(self, replay: TraceReplay, n_prefill: int, n_decode: int, *, host: str = "127.0.0.1",
                 base_port: int = 18300, max_seqs: int = 256, model_name: str = "eldr-emulated",
                 prefill_max_tokens: int = 8192):
        self.replay, self.host = replay, host
        self.prefill = [PrefillWorker(i, replay, model_name, host, base_port + i, max_batched_tokens=prefill_max_tokens)
                        for i in range(n_prefill)]
        self.decode = [DecodeWorker(i, replay, model_name, host, base_port + n_prefill + i, max_seqs=max_seqs)
                       for i in range(n_decode)]
        self._runners = []

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{w.host}:{w.port}" for w in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{w.host}:{w.port}" for w in self.decode]

    async def start(self) -> None:
        from aiohttp import web

        from eldr_cli.errors import EldrError

        for w in [*self.prefill, *self.decode]:
            runner = web.AppRunner(make_app(w), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, w.host, w.port, reuse_address=True)
            try:
                await site.start()
            except OSError as e:
                await self.stop()
                raise EldrError(f"cannot listen on {w.host}:{w.port}: {e.strerror}",
                                hint="choose another --base-port") from None
            self._runners.append(runner)
            w.start()

    async def stop(self) -> None:
        for w in [*self.prefill, *self.decode]:
            await w.stop()
        for r in self._runners:
            await r.cleanup()
        self._runners = []


def serve_cluster(*, trace, cost_model, n_prefill: int, n_decode: int, host: str = "127.0.0.1",
                  base_port: int = 18300, max_seqs: int = 256, model_name: str | None = None,
                  cluster_file=None, ready=None) -> None:
    """Run an emulated cluster until SIGINT/SIGTERM (``eldr emulate``). ``cluster_file`` gets
    {"mode": "emulated", "prefill": [...], "decode": [...]} once every port listens."""
    import json
    import os
    import signal
    from pathlib import Path

    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.bench.client import new_event_loop
    from eldr_cli.costmodel import CostModel
    from eldr_cli.errors import EldrError

    if n_prefill < 1 or n_decode < 1:
        raise EldrError("--prefill and --decode must be >= 1")
    if not (0 < base_port and base_port + n_prefill + n_decode <= 65536):
        raise EldrError(f"--base-port {base_port} leaves no room for {n_prefill + n_decode} ports")
    cost = CostModel.load(cost_model)
    tr = read_trace(trace)
    replay = TraceReplay(tr, cost)
    name = model_name or str(tr.model.get("model") or "eldr-emulated")
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    cluster = EmulatedCluster(replay, n_prefill, n_decode, host=host, base_port=base_port, max_seqs=max_seqs,
                              model_name=name)
    stop = asyncio.Event()

    async def main():
        await cluster.start()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        info = {"mode": "emulated", "pid": os.getpid(), "model": name, "prefill": cluster.prefill_urls,
                "decode": cluster.decode_urls, "trace": str(trace), "cost_model": str(cost_model),
                "n_layers": replay.n_layers, "num_experts": replay.num_experts}
        if cluster_file:
            p = Path(cluster_file)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(json.dumps(info, indent=2))
            os.replace(tmp, p)
        if ready:
            ready(info)
        await stop.wait()
        await cluster.stop()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
