"""A small real OpenAI-compatible server with a Prometheus /metrics page in vLLM or SGLang format.

    python -m tests.fake_openai_server --port 8101 --engine vllm

`POST /control {"waiting": 40, "fail": 0, "fail_delay_ms": 0, "token_delay_ms": 0}` sets what /metrics
reports, how many of the next completions fail with HTTP 503 (each after `fail_delay_ms`: an upstream
that fails slowly), and the pause between streamed tokens. Completions stream `tokens` words (the
request's max_tokens). `GET /stats` lists under "arrivals" when each completion request arrived
(`time.monotonic()`, comparable across processes on one host).

`GET /v1/models` lists the model with `max_model_len` when `--max-model-len` is given (as vLLM and
SGLang do), without it otherwise (as TensorRT-LLM does); the max_tokens of every completion request is
recorded in `GET /stats` under "max_tokens". `--no-cache-info` leaves the KV capacity out of /metrics.

Pass-through checks: streams give `n` choices; the last request body and Authorization header are
in `GET /stats` ("last_body", "last_authorization"); a request with `tools` is answered with a call of
its first tool, one with `logprobs` with per-token logprobs (streamed and not). `--api-key K` refuses /v1/*
requests without `Authorization: Bearer K` (401), as `vllm serve --api-key` does.

Managed-engine checks: `GET /health` is 200; `--start-delay S` waits S seconds before serving (a model
load); `--children N` starts N child processes (as vLLM starts workers), their pids and this
server's own in `GET /stats` ("children", "pid").

`--embeds-only` acts as `vllm serve --enable-mm-embeds --limit-mm-per-prompt '{"image":0}'`: image_url
parts are refused with 400, and image_embeds parts are decoded as vLLM does (base64 → torch.load with
weights_only) and their shapes recorded in `GET /stats` under "image_embeds".
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

METRICS = {
    "vllm": (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.25\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{{block_size="16",num_gpu_blocks="4096",engine="0"}} 1.0\n'
    ),
    "sglang": (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{{model_name="m"}} {waiting}\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{{model_name="m"}} {running}\n'
        "# TYPE sglang:token_usage gauge\n"
        'sglang:token_usage{{model_name="m"}} 0.25\n'
    ),
}


def _load_tensor(b64: str) -> Any:
    import torch

    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)


def image_embeds(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Shapes of the request's image_embeds parts; ValueError for an image_url part (images disabled)."""
    seen = []
    for message in body.get("messages") or ():
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            if part.get("type") == "image_url":
                raise ValueError("At most 0 image(s) may be provided in one prompt.")
            if part.get("type") == "image_embeds":
                embeds = part["image_embeds"]
                grid = None
                if isinstance(embeds, dict):
                    grid = _load_tensor(embeds["image_grid_thw"]).tolist()
                    embeds = embeds["image_embeds"]
                tensor = _load_tensor(embeds)
                seen.append({"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "finite": bool(tensor.isfinite().all()), "grid": grid})
    return seen


def n_tokens(body: dict[str, Any]) -> int:
    return int(body.get("max_tokens") or 8)


def tool_call(body: dict[str, Any]) -> dict[str, Any]:
    name = body["tools"][0]["function"]["name"]
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}


def token_logprobs(token: str, i: int) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5 - i, "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": -0.5 - i, "bytes": list(token.encode())}]}


def create_app(
    engine: str, embeds_only: bool = False, max_model_len: int | None = None, cache_info: bool = True,
    api_key: str | None = None, children: list[int] | None = None,
) -> FastAPI:
    app = FastAPI()
    state: dict[str, Any] = {"waiting": 0, "running": 0, "fail": 0, "fail_delay_ms": 0, "served": 0, "image_embeds": [],
                             "token_delay_ms": 1, "max_tokens": [], "last_body": None, "last_authorization": None,
                             "pid": os.getpid(), "children": children or [], "arrivals": []}
    metrics_text = "".join(line for line in METRICS[engine].splitlines(keepends=True)
                           if cache_info or "cache_config_info" not in line)

    @app.get("/health")
    async def health() -> Response:
        return Response(b"", status_code=200)

    @app.post("/control")
    async def control(request: Request) -> dict[str, Any]:
        state.update(orjson.loads(await request.body()))
        return state

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text.format(**state), media_type="text/plain")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {"id": "served-model", "object": "model", "created": 1, "owned_by": engine}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return {"object": "list", "data": [card]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        """Compact JSON events as vLLM writes them, with an extra field a relay must keep."""
        n = n_tokens(body)
        head = {"id": f"upstream-{state['served']}", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": body.get("model", "")}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({**head, "choices": choices, "engine_marker": 7, **extra}) + b"\n\n"

        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if chat and body.get("tools"):
            call = tool_call(body)
            arguments = call["function"].pop("arguments")
            yield event([{"index": 0, "delta": {"tool_calls": [{"index": 0, **call, "function": {
                **call["function"], "arguments": ""}}]}, "finish_reason": None}])
            yield event([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]},
                          "finish_reason": "tool_calls"}])
            yield event([], usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
            yield b"data: [DONE]\n\n"
            return
        for i in range(n):
            for c in range(int(body.get("n") or 1)):   # one event per choice, as vLLM sends them
                choice: dict[str, Any] = {"index": c, "finish_reason": "length" if i == n - 1 else None}
                if chat:
                    choice["delta"] = {"content": f"w{i} "}
                    if body.get("logprobs"):
                        choice["logprobs"] = {"content": [token_logprobs(f"w{i} ", i)]}
                else:
                    choice["text"] = f"w{i} "
                yield event([choice])
            await asyncio.sleep(state["token_delay_ms"] / 1000)
        yield event([], usage={"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3})
        yield b"data: [DONE]\n\n"

    def whole(body: dict[str, Any], chat: bool) -> bytes:
        """A non-streamed reply as vLLM writes it, with the same extra field."""
        n = n_tokens(body)
        text = "".join(f"w{i} " for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat and body.get("tools"):
            choice.update(finish_reason="tool_calls",
                          message={"role": "assistant", "content": None, "tool_calls": [tool_call(body)]})
        elif chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [token_logprobs(f"w{i} ", i) for i in range(n)]}
        else:
            choice["text"] = text
        return orjson.dumps({
            "id": f"upstream-{state['served']}", "object": "chat.completion" if chat else "text_completion",
            "created": 1, "model": body.get("model", ""), "choices": [choice], "engine_marker": 7,
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
        })

    async def complete(request: Request, chat: bool) -> Response:
        state["arrivals"].append(time.monotonic())
        body = orjson.loads(await request.body())
        state["last_body"], state["last_authorization"] = body, request.headers.get("authorization")
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return Response(orjson.dumps({"error": {"message": "Unauthorized"}}), status_code=401)
        if state["fail"] > 0:
            state["fail"] -= 1
            await asyncio.sleep(state["fail_delay_ms"] / 1000)
            return Response(orjson.dumps({"error": {"message": "overloaded"}}), status_code=503)
        if embeds_only:
            try:
                state["image_embeds"] += image_embeds(body)
            except ValueError as exc:
                return Response(orjson.dumps({"error": {"message": str(exc)}}), status_code=400)
        state["served"] += 1
        state["max_tokens"].append(body.get("max_tokens"))
        if not body.get("stream"):
            await asyncio.sleep(n_tokens(body) * state["token_delay_ms"] / 1000)
            return Response(whole(body, chat), media_type="application/json")
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, False)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return state

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", choices=sorted(METRICS), default="vllm")
    p.add_argument("--embeds-only", action="store_true")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-cache-info", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds before serving (a model load)")
    p.add_argument("--children", type=int, default=0, help="child processes to start (as engine workers)")
    args = p.parse_args()
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    workers = [subprocess.Popen(sleeper).pid for _ in range(args.children)]
    time.sleep(args.start_delay)
    app = create_app(args.engine, args.embeds_only, args.max_model_len, cache_info=not args.no_cache_info,
                     api_key=args.api_key, children=workers)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
