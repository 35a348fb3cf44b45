"""OpenAI response bodies and server-sent events, rendered with orjson."""

from __future__ import annotations

import time
from typing import Any, Literal

import orjson

from common.wire import engine_pb2
from gateway.requests.errors import RequestError, openai_error_body

Kind = Literal["chat", "text"]
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` where the engine said how much of the
    prompt its prefix cache held (as vLLM's with `--enable-prompt-tokens-details`)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_tokens(u: engine_pb2.Usage) -> int | None:
    """Of the prompt, the tokens the engine found in its prefix cache; None where it did not say."""
    return u.cached_tokens if u.HasField("cached_tokens") else None


def usage_of(u: engine_pb2.Usage) -> dict[str, Any]:
    return usage(u.prompt_tokens, u.completion_tokens, cached_tokens(u))


def completion_id(kind: Kind, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def completion_body(
    kind: Kind, request_id: str, model: str, text: str, finish_reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {
        "id": completion_id(kind, request_id),
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


class ChunkWriter:
    """Builds the SSE events of one streamed completion."""

    def __init__(self, kind: Kind, request_id: str, model: str) -> None:
        self.kind = kind
        self._head = {
            "id": completion_id(kind, request_id),
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": choices, **extra}) + b"\n\n"

    def role(self) -> bytes:
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def token(self, text: str, finish_reason: str | None) -> bytes:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._event([choice])

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return self._event([], usage=usage_)


def error_event(err: RequestError) -> bytes:
    return b"data: " + orjson.dumps(openai_error_body(err)) + b"\n\n"
