"""OpenAI-shaped response bodies and SSE chunks, as vLLM's OpenAI server writes them.

One builder for the two servers that only *pretend* to be vLLM: the emulated cluster
(:mod:`eldr_cli.emulator`, product code behind ``eldr emulate``) and the fault-injection stub worker of
:mod:`eldr_cli.testing`. Keeping the shapes in one place means a client (the proxy, the official
``openai`` client, the load generator) sees the same fields from both, and a fix to the shape reaches
both. Only what those servers need is built: one choice, text content, ``finish_reason``,
``usage``; streamed choices carry ``logprobs: null`` (and ``stop_reason: null`` for completions) as
vLLM's do.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"


def new_id(chat: bool) -> str:
    """A fresh response id with vLLM's prefix (``chatcmpl-`` or ``cmpl-``)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(*, rid: str, model: str, created: int, chat: bool, text: str, finish_reason: str | None,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A non-streaming answer: ``text_completion`` (``choices[0].text``) or ``chat.completion``
    (``choices[0].message``)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(*, rid: str, model: str, created: int, chat: bool, text: str, first: bool,
               finish_reason: str | None) -> dict[str, Any]:
    """One streamed chunk with one choice. Chat: the first chunk's delta carries ``role``; a closing
    chunk without text (``text == ""`` and a ``finish_reason``) has an empty delta."""
    if chat:
        if not text and finish_reason:
            delta: dict[str, Any] = {}
        else:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk_body(*, rid: str, model: str, created: int, chat: bool, prompt_tokens: int,
                     completion_tokens: int) -> dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: no choices, only ``usage``."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def error_body(message: str, type_: str = "BadRequest") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_}}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"
