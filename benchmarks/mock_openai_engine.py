"""A fast OpenAI-compatible mock engine for front-door benchmarks: answers at once, keep-alive HTTP/1.1.

    python benchmarks/mock_openai_engine.py --port 9101 [--model mock]

Written on a bare asyncio protocol with httptools (no framework) so that the engine costs as little
CPU as possible and the gateway under test, not the engine, is what the benchmark measures.
`POST /v1/chat/completions` and `/v1/completions` answer `max_tokens` tokens ("tok"), one SSE event
each when `stream` is true (vLLM's compact JSON, usage last when asked), else one JSON body.
`GET /v1/models`, `/health` and `/metrics` (vLLM names, idle) answer too, so every router can probe it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httptools
import orjson

_MODELS = b'{"object":"list","data":[{"id":"%s","object":"model","max_model_len":32768}]}'
_METRICS = (b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            b"vllm:gpu_cache_usage_perc 0\nvllm:kv_cache_usage_perc 0\n")


def _head(status: bytes, ctype: bytes, length: int | None) -> bytes:
    size = b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
    return b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\n" + size + b"\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Engine(asyncio.Protocol):
    def __init__(self, model: str) -> None:
        self._model = model
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._transport: Any = None   # uvloop's transports are not asyncio.Transport subclasses

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, body = self._url, b"".join(self._body)
        self._body = []
        self._transport.write(self._answer(url, body))

    def _answer(self, url: bytes, body: bytes) -> bytes:
        if url.startswith(b"/v1/chat/completions") or url.startswith(b"/v1/completions"):
            return self._complete(url.startswith(b"/v1/chat"), orjson.loads(body))
        if url.startswith(b"/v1/models"):
            data = _MODELS % self._model.encode()
        elif url.startswith(b"/metrics"):
            return _head(b"200 OK", b"text/plain", len(_METRICS)) + _METRICS
        else:
            data = b"{}"
        return _head(b"200 OK", b"application/json", len(data)) + data

    def _complete(self, chat: bool, req: dict[str, Any]) -> bytes:
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        model = req.get("model", self._model)
        usage = {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}
        obj, key = ("chat.completion", "message") if chat else ("text_completion", "text")
        if not req.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice[key] = {"role": "assistant", "content": "tok" * n} if chat else "tok" * n
            data = orjson.dumps({"id": "cmpl-mock", "object": obj, "created": 0, "model": model,
                                 "choices": [choice], "usage": usage})
            return _head(b"200 OK", b"application/json", len(data)) + data
        out = [_head(b"200 OK", b"text/event-stream", None)]
        for i in range(n):
            last = i == n - 1
            delta: Any = {"content": "tok"} if chat else None
            choice = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = "tok"
            event = {"id": "cmpl-mock", "object": obj + ".chunk", "created": 0, "model": model, "choices": [choice]}
            out.append(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
        if (req.get("stream_options") or {}).get("include_usage"):
            event = {"id": "cmpl-mock", "object": obj + ".chunk", "created": 0, "model": model, "choices": [],
                     "usage": usage}
            out.append(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
        out.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return b"".join(out)


async def serve(port: int, model: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Engine(model), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="mock")
    args = p.parse_args()
    try:
        import uvloop
        uvloop.run(serve(args.port, args.model))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
