"""A tiny in-process worker speaking vLLM's PD protocol, for fault tests and benchmarks ONLY.

Not a model: it answers at once with deterministic fake tokens. A request whose
``kv_transfer_params.do_remote_decode`` is true is a prefill leg (1 token, ``kv_transfer_params``
with fake remote blocks and, unless disabled, ``eldr_signature`` = the prompt's fake expert counts);
anything else is a decode leg (``max_tokens`` tokens, SSE when ``stream``). Faults are injected by
a marker in the prompt text (passes through the proxy unchanged): ``[[fault:KIND]]`` with KIND in
``prefill_500 prefill_400 prefill_timeout prefill_nosig prefill_badsig decode_500 decode_drop decode_slow``,
or for the whole worker with ``StubWorker.fail`` = "500" | "timeout".

Run standalone (for benchmarks): ``python -m eldr_cli.testing.stub_worker --port P1 --port P2 ...``.
"""

from __future__ import annotations

import asyncio
import collections
import re
import zlib

import numpy as np
import orjson

from eldr_cli import openai_shapes as shapes
from eldr_cli.handoff import SIGNATURE_KEY, encode_counts

_FAULT = re.compile(r"\[\[fault:([a-z_0-9]+)\]\]")


def fake_counts(text: str, shape=(4, 16), top_k: int = 4) -> np.ndarray:
    """Deterministic fake prompt expert counts [L, E] from the prompt text."""
    rng = np.random.default_rng(zlib.crc32(text.encode("utf-8", "surrogatepass")))
    L, E = shape
    tokens = max(1, len(text.split()))
    p = rng.dirichlet(np.full(E, 0.3), size=L)
    return np.stack([rng.multinomial(tokens * top_k, p[l]) for l in range(L)]).astype(np.int64)


def prompt_text(body: dict) -> str:
    if "messages" in body:
        out = []
        for m in body.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            out.append(str(c or ""))
        return "\n".join(out)
    p = body.get("prompt", "")
    if isinstance(p, list):
        p = p[0] if p else ""
        if isinstance(p, list) or isinstance(p, int):
            return " ".join(map(str, body["prompt"] if isinstance(p, int) else p))
    return str(p)


class StubWorker:
    def __init__(self, name: str = "stub", shape=(4, 16), counts_fn=None, signature: bool = True,
                 token_delay_s: float = 0.0, timeout_sleep_s: float = 30.0, record: int = 256):
        self.name = name
        self.shape = tuple(shape)
        if counts_fn is None:
            import functools

            counts_fn = functools.lru_cache(maxsize=4096)(lambda text: fake_counts(text, self.shape))
        self.counts_fn = counts_fn
        self._encoded: dict[str, dict] = {}
        self.signature = signature
        self.token_delay_s = token_delay_s
        self.timeout_sleep_s = timeout_sleep_s
        self.fail: str | None = None
        self.healthy = True
        self.running = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.decode_bodies: collections.deque = collections.deque(maxlen=record)
        self.prefill_bodies: collections.deque = collections.deque(maxlen=record)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            return await _reply(send, 200 if self.healthy else 503, b"{}")
        if path == "/metrics":
            txt = f'vllm:num_requests_running{{model_name="{self.name}"}} {self.running}\n'
            return await _reply(send, 200, txt.encode(), b"text/plain")
        if path == "/v1/models":
            return await _reply(send, 200, orjson.dumps({"object": "list", "data": [
                {"id": "stub-model", "object": "model", "owned_by": self.name}]}))
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await _reply(send, 404, b'{"error": "not found"}')
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = orjson.loads(raw)
        ktp = body.get("kv_transfer_params")
        chat = path.endswith("chat/completions")
        self.running += 1
        try:
            if isinstance(ktp, dict) and ktp.get("do_remote_decode"):
                await self._prefill(body, chat, send)
            else:
                await self._decode(body, chat, receive, send)
        finally:
            self.running -= 1

    async def _prefill(self, body, chat, send):
        self.stats["prefill"] += 1
        self.prefill_bodies.append(body)
        text = prompt_text(body)
        found = _FAULT.search(text)
        fault = found.group(1) if found else None
        if self.fail == "500" or fault == "prefill_500":
            self.stats["prefill_500"] += 1
            return await _reply(send, 500, b'{"error": {"message": "injected prefill failure"}}')
        if fault == "prefill_400":
            self.stats["prefill_400"] += 1
            return await _reply(send, 400, b'{"error": {"message": "injected: prompt too long"}}')
        if self.fail == "timeout" or fault == "prefill_timeout":
            self.stats["prefill_timeout"] += 1
            await asyncio.sleep(self.timeout_sleep_s)
            return await _reply(send, 500, b'{"error": {"message": "late"}}')
        ktp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
               "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600}
        if self.signature and fault != "prefill_nosig":
            enc = self._encoded.get(text)
            if enc is None:
                enc = encode_counts(self.counts_fn(text))
                if len(self._encoded) < 4096:
                    self._encoded[text] = enc
            ktp[SIGNATURE_KEY] = dict(enc)
        if fault == "prefill_badsig":
            ktp[SIGNATURE_KEY] = {"v": 1, "shape": [2, 2], "dtype": "u1", "encoding": "zlib+b64", "data": "!!"}
        n_prompt = len(text.split())
        ans = _answer(body, chat, [" first"], "length", n_prompt)
        ans["kv_transfer_params"] = ktp
        await _reply(send, 200, orjson.dumps(ans))

    async def _decode(self, body, chat, receive, send):
        self.stats["decode"] += 1
        self.decode_bodies.append(body)
        text = prompt_text(body)
        found = _FAULT.search(text)
        fault = found.group(1) if found else None
        if self.fail == "500" or fault == "decode_500":
            self.stats["decode_500"] += 1
            return await _reply(send, 500, b'{"error": {"message": "injected decode failure"}}')
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        seed = zlib.crc32(text.encode("utf-8", "surrogatepass"))
        toks = [f" w{(seed + i) % 997}" for i in range(n)]
        n_prompt = len(text.split())
        if not body.get("stream"):
            if fault == "decode_slow":
                await asyncio.sleep(self.timeout_sleep_s)
            return await _reply(send, 200, orjson.dumps(_answer(body, chat, toks, "length", n_prompt)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            for i, t in enumerate(toks):
                if watch.done():
                    self.stats["decode_cancelled"] += 1
                    return
                if fault == "decode_drop" and i == len(toks) // 2:
                    self.stats["decode_drop"] += 1
                    raise ConnectionAbortedError("injected: decode worker dies mid-stream")
                delay = self.timeout_sleep_s if fault == "decode_slow" else self.token_delay_s
                if delay:
                    await asyncio.wait({watch}, timeout=delay)
                    if watch.done():
                        self.stats["decode_cancelled"] += 1
                        return
                await send({"type": "http.response.body", "more_body": True,
                            "body": shapes.sse(_chunk(body, chat, t, i, None))})
            last = _chunk(body, chat, "", len(toks), "length")
            if (body.get("stream_options") or {}).get("include_usage"):
                last["usage"] = shapes.usage(n_prompt, len(toks))
            await send({"type": "http.response.body", "more_body": True, "body": shapes.sse(last) + shapes.SSE_DONE})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.stats["decode_ok"] += 1
        finally:
            watch.cancel()


STUB_ID = "cmpl-stub"  # fixed id and created=0: the stub's answers are deterministic


def _answer(body, chat, toks, finish, n_prompt):
    return shapes.completion_body(rid=STUB_ID, model=body.get("model") or "stub-model", created=0, chat=chat,
                                  text="".join(toks), finish_reason=finish, prompt_tokens=n_prompt,
                                  completion_tokens=len(toks))


def _chunk(body, chat, tok, i, finish):
    return shapes.chunk_body(rid=STUB_ID, model=body.get("model") or "stub-model", created=0, chat=chat, text=tok,
                             first=i == 0, finish_reason=finish)


async def _disconnected(receive):
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def _reply(send, status, body: bytes, ctype: bytes = b"application/json"):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv=None):
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description="stub PD workers (fault tests / benchmarks only)")
    ap.add_argument("--port", type=int, action="append", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--no-signature", action="store_true")
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    ap.add_argument("--timeout-sleep-s", type=float, default=30.0)
    a = ap.parse_args(argv)

    async def run():
        servers = []
        for p in a.port:
            app = StubWorker(name=f"stub-{p}", shape=(a.layers, a.experts), signature=not a.no_signature,
                             token_delay_s=a.token_delay_s, timeout_sleep_s=a.timeout_sleep_s)
            cfg = uvicorn.Config(app, host="127.0.0.1", port=p, http="httptools", loop="none",
                                 log_level="critical", access_log=False, lifespan="off", backlog=4096)
            servers.append(uvicorn.Server(cfg))
        await asyncio.gather(*(s.serve() for s in servers))

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
