"""A small real OpenAI-compatible server with a Prometheus /metrics page in vLLM or SGLang format.

    python -m tests.fake_openai_server --port 8101 --engine vllm

`POST /control {"waiting": 40, "fail": 0}` sets what /metrics reports and how many of the next
completions fail with HTTP 503. Completions stream `tokens` words (the request's max_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
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


def create_app(engine: str) -> FastAPI:
    app = FastAPI()
    state: dict[str, int] = {"waiting": 0, "running": 0, "fail": 0, "served": 0}

    @app.post("/control")
    async def control(request: Request) -> dict[str, int]:
        state.update(orjson.loads(await request.body()))
        return state

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(METRICS[engine].format(**state), media_type="text/plain")

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        n = int(body.get("max_tokens") or 8)
        for i in range(n):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            if chat:
                choice["delta"] = {"content": f"w{i} "}
            else:
                choice["text"] = f"w{i} "
            yield b"data: " + orjson.dumps({"id": "x", "choices": [choice]}) + b"\n\n"
            await asyncio.sleep(0.001)
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
        yield b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def complete(request: Request, chat: bool) -> Response:
        body = orjson.loads(await request.body())
        if state["fail"] > 0:
            state["fail"] -= 1
            return Response(orjson.dumps({"error": {"message": "overloaded"}}), status_code=503)
        state["served"] += 1
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, False)

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        return state

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", choices=sorted(METRICS), default="vllm")
    args = p.parse_args()
    uvicorn.run(create_app(args.engine), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
