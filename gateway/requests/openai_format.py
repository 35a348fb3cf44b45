"""OpenAI response bodies and server-sent events, rendered with orjson."""

from __future__ import annotations

import time
from typing import Any, Literal

import orjson

from gateway.requests.errors import RequestError, openai_error_body

Kind = Literal["chat", "text"]
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_id(kind: Kind, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def completion_body(
    kind: Kind, request_id: str, model: str, text: str, finish_reason: str, usage_: dict[str, int]
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

    def usage(self, usage_: dict[str, int]) -> bytes:
        return self._event([], usage=usage_)


def error_event(err: RequestError) -> bytes:
    return b"data: " + orjson.dumps(openai_error_body(err)) + b"\n\n"
