"""What the proxy knows about one client request (:class:`RequestContext`) and the bodies of its two legs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from eldr_cli.proxy.replicas.reserve import Slot
from eldr_cli.proxy.workers import Worker

if TYPE_CHECKING:
    from eldr_cli.routing import Decision

PREFILL_KTP = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class RequestContext:
    """What the proxy knows about one client request while it is served (and logs at the end)."""

    rid: str
    endpoint: str                      # "completions" | "chat"
    domain: str | None = None          # X-Eldr-Domain (the Domain baseline's oracle label)
    auth: bytes | None = None          # the client's Authorization header, passed upstream
    t0: float = field(default_factory=time.perf_counter)
    prefill: str | None = None         # worker ids as chosen
    decode: str | None = None
    policy: str | None = None
    reason: str | None = None          # why the request did not end "ok"
    delivered: bool = False            # [DONE] (or the whole answer) reached the client
    reserved: Slot | None = None       # the decode slot reserved in the shared state
    decode_index: int | None = None    # the decoder the router's live set holds the request on ...
    held: Worker | None = None         # ... and whose in-flight count holds it
    choice: Decision | None = None     # the decision it is held on (a router rebuilt over a new pool takes it again)


def context_tokens(answer: dict[str, Any], body: dict[str, Any]) -> int | None:
    """The KV tokens the request will hold on its decoder, on average over its decode: the prompt (from the
    prefill answer's usage) plus half its output budget. None when the prefill worker did not say."""
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
        return None
    out = body.get("max_completion_tokens", body.get("max_tokens"))
    return prompt + (out // 2 if isinstance(out, int) and not isinstance(out, bool) and out > 0 else 0)


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg's body: one token, not streamed, asking for remote decode (vLLM's PD protocol)."""
    pre = dict(body)
    pre["stream"] = False
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre.pop("min_tokens", None)
    pre.pop("stream_options", None)
    pre["kv_transfer_params"] = dict(PREFILL_KTP)
    return orjson.dumps(pre)
