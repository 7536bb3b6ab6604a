"""The load generator of `eldr bench serve`: an asyncio client (aiohttp, one connection pool) that sends
a schedule's requests to an OpenAI-compatible `/v1/completions` endpoint, streams the answers and times
every token.

Timing honesty: a dispatcher coroutine sleeps until each request's scheduled offset and starts it as
a task; the gap between the scheduled and the actual start is the request's *scheduling lag*
(recorded per request and summarized as ``median_schedule_lag_ms``). Before a run the client
moves the objects alive at the start out of the garbage collector's way (``gc.freeze``), so
collector pauses do not become lag. Token times are
taken when a chunk is read off the socket; the SSE parsing is kept minimal (orjson on each event).
uvloop runs the loop when available.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from eldr_cli.bench.workload import PromptItem, Schedule
from eldr_cli.errors import EldrError

DOMAIN_HEADER = "X-Eldr-Domain"


@dataclass
class ClientConfig:
    url: str
    model: str | None = None
    max_tokens: int = 512
    ignore_eos: bool = True
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    domain_header: bool = False
    api_key: str | None = None
    endpoint: str = "/v1/completions"
    extra_body: dict = field(default_factory=dict)


@dataclass
class LiveStats:
    """What the live view shows while a run is in flight."""

    router: str = ""
    rate: float = 0.0
    scheduled: int = 0
    sent: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    tokens: int = 0
    started: float = 0.0
    horizon_s: float = 0.0
    lag_ms: list = field(default_factory=list)
    last_tpot_ms: list = field(default_factory=list)


def base_url(url: str) -> str:
    u = url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if u.endswith(suffix):
            return u[: -len(suffix)]
    return u


async def probe(session, cfg: ClientConfig) -> str:
    """Check the endpoint answers and return the model name to send (``--model`` or the first served)."""
    import aiohttp

    url = base_url(cfg.url)
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=cfg.connect_timeout_s)) as r:
            if r.status == 200:
                data = await r.json(content_type=None)
                models = [m.get("id") for m in (data or {}).get("data", []) if isinstance(m, dict)]
                if cfg.model:
                    return cfg.model
                if models:
                    return str(models[0])
            elif cfg.model:
                return cfg.model
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise EldrError(f"cannot reach {url}: {type(e).__name__}: {e}",
                        hint="start the server (or the proxy) first and check --url") from None
    if cfg.model:
        return cfg.model
    raise EldrError(f"{url}/v1/models did not list a model; pass --model")


def _request(cfg: ClientConfig, model: str, item: PromptItem) -> tuple[dict[str, Any], dict[str, str]]:
    """The streamed completion request for ``item``: (JSON body, headers)."""
    body = {"model": model, "prompt": item.prompt, "max_tokens": cfg.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, **cfg.extra_body}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    if cfg.domain_header and item.domain:
        headers[DOMAIN_HEADER] = str(item.domain)
    return body, headers


class _Answer:
    """What one streamed answer carried: token arrival times, usage, and how it ended."""

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.finished = False
        self.outcome: str = "ok"
        self.error: str | None = None

    def feed(self, ev: bytes, now: float, stats: LiveStats) -> None:
        """One server-sent event (``data: {...}`` or ``data: [DONE]``) that arrived at ``now``."""
        if not ev.startswith(b"data:"):
            return
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            self.finished = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.outcome, self.error = "error", f"malformed SSE event: {payload[:80]!r}"
            return
        if obj.get("error"):
            self.outcome, self.error = "error", str(obj["error"])[:300]
            return
        ch = obj.get("choices") or []
        if ch:
            c0 = ch[0]
            txt = c0.get("text")
            if txt is None:
                txt = (c0.get("delta") or {}).get("content")
            if txt:
                self.token_times.append(now)
                stats.tokens += 1
        if obj.get("usage"):
            self.usage = obj["usage"]

    async def read(self, resp, stats: LiveStats) -> None:
        """Consume the response's event stream."""
        buf = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                self.feed(ev.strip(), now, stats)
        if self.outcome == "ok" and not self.finished:
            self.outcome, self.error = "incomplete", "stream ended without [DONE]"


async def _one(session, cfg: ClientConfig, model: str, item: PromptItem, rid: int, sched_t: float, t_zero: float,
               rec: dict, stats: LiveStats) -> None:
    import aiohttp

    body, headers = _request(cfg, model, item)
    t_send = time.perf_counter()
    rec["sent_s"] = t_send - t_zero
    rec["lag_ms"] = (t_send - (t_zero + sched_t)) * 1e3
    stats.lag_ms.append(rec["lag_ms"])
    a = _Answer()
    try:
        async with session.post(base_url(cfg.url) + cfg.endpoint, data=orjson.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s,
                                                              sock_connect=cfg.connect_timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                a.outcome, a.error = "http_error", f"HTTP {resp.status}: {text}"
            else:
                await a.read(resp, stats)
    except asyncio.TimeoutError:
        a.outcome, a.error = "timeout", f"no complete answer within {cfg.timeout_s:g} s"
    except aiohttp.ClientConnectorError as e:
        a.outcome, a.error = "connect_error", str(e)[:300]
    except (aiohttp.ClientError, OSError) as e:
        a.outcome, a.error = ("incomplete" if a.token_times else "connect_error"), f"{type(e).__name__}: {e}"[:300]
    _record(rec, stats, a, t_send)


def _record(rec: dict, stats: LiveStats, a: _Answer, t_send: float) -> None:
    """The request's row (outcome, TTFT, TPOT, ITL, E2EL) and the live counters, from its answer."""
    token_times, usage = a.token_times, a.usage
    if a.outcome == "ok" and not token_times:
        a.outcome, a.error = "incomplete", "no tokens streamed"
    outcome = a.outcome
    n_out = int(usage.get("completion_tokens", len(token_times))) if usage else len(token_times)
    rec["outcome"], rec["error"] = outcome, a.error
    rec["prompt_tokens"] = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") is not None else None
    rec["output_tokens"] = n_out if outcome == "ok" else len(token_times)
    if token_times:
        rec["ttft_ms"] = (token_times[0] - t_send) * 1e3
        rec["e2el_ms"] = (token_times[-1] - t_send) * 1e3
        if len(token_times) > 1:
            rec["itl_ms"] = list(np.diff(token_times) * 1e3)
        if n_out > 1 and outcome == "ok":
            rec["tpot_ms"] = (token_times[-1] - token_times[0]) * 1e3 / (n_out - 1)
            stats.last_tpot_ms.append(rec["tpot_ms"])
    else:
        rec["e2el_ms"] = (time.perf_counter() - t_send) * 1e3
    if outcome == "ok":
        stats.done += 1
    else:
        stats.failed += 1
    stats.in_flight -= 1


async def _sleep_until(deadline: float) -> None:
    """Sleep to ``deadline`` (perf_counter). No busy-wait: uvloop's timers are accurate to about a
    millisecond, and spinning would steal the CPU the streams need on a small machine."""
    d = deadline - time.perf_counter()
    if d > 0:
        await asyncio.sleep(d)


async def run_schedule(session, cfg: ClientConfig, model: str, prompts: list[PromptItem], schedule: Schedule,
                       router: str, stats: LiveStats, drain_timeout_s: float | None = None) -> list[dict]:
    """Send one schedule; wait for every request (each bounded by the request timeout)."""
    import gc

    gc.collect()
    gc.freeze()  # long-lived objects out of the collector's way: no full-heap GC pauses mid-run
    n = len(schedule)
    recs: list[dict] = []
    tasks = []
    stats.router, stats.rate, stats.scheduled = router, schedule.rate, n
    stats.sent = stats.done = stats.failed = stats.in_flight = stats.tokens = 0
    stats.lag_ms, stats.last_tpot_ms = [], []
    stats.horizon_s = schedule.warmup_s + schedule.duration_s
    t_zero = time.perf_counter() + 0.05
    stats.started = t_zero
    for i in range(n):
        item = prompts[schedule.prompt_index[i]]
        off = float(schedule.offsets[i])
        rec = {"request_id": f"{router}-{schedule.rate:g}-{i}", "router": router, "request_rate": schedule.rate,
               "prompt_index": int(schedule.prompt_index[i]), "domain": item.domain, "scheduled_s": off,
               "warmup": bool(schedule.warmup[i]), "outcome": "error"}
        recs.append(rec)
        await _sleep_until(t_zero + off)
        stats.sent += 1
        stats.in_flight += 1
        tasks.append(asyncio.create_task(_one(session, cfg, model, item, i, off, t_zero, rec, stats)))
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            for r in recs:
                if r.get("sent_s") is not None and "ttft_ms" not in r and r["outcome"] == "error":
                    r["outcome"], r["error"] = "timeout", "cancelled at the end of the run (drain timeout)"
        for t in done:
            exc = t.exception()
            if exc is not None:
                raise exc
    return recs


def make_session(cfg: ClientConfig):
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=False)


def new_event_loop():
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def run_interruptible(loop, coro):
    """``loop.run_until_complete(coro)`` where Ctrl-C cancels the bench's task (its cleanup runs) and then
    raises KeyboardInterrupt here, instead of the interrupt landing wherever the loop happens to be, e.g.
    inside a uvloop transport callback, which printed a traceback of its own."""
    import signal

    task = loop.create_task(coro)
    interrupted = []

    def on_sigint() -> None:
        interrupted.append(True)
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        return loop.run_until_complete(task)
    try:
        result = loop.run_until_complete(task)
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if interrupted:  # the task swallowed the cancellation: still an interrupt
        raise KeyboardInterrupt
    return result
