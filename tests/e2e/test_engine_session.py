"""Many clients at once through a real gateway in front of one managed simulated engine: every request
travels over the gateway's one Session stream to that engine, and every client gets its own answer.

The simulated engine stops each request at a length drawn from its request id (x-request-id is
honoured), so the right answer for each client is known: its own length, its own usage, the words at
its own token positions. Crossed streams would hand a client another request's tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from backends.sim_executor import natural_length
from testkit.harness import run_gateway, sse_payloads, write_config

MODEL = "llava-1.5-7b"
WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")

pytestmark = pytest.mark.timeout(120)


def expected_text(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] + " " for i in range(tokens))


def test_concurrent_clients_over_one_engine_stream_get_their_own_answers(tmp_path: Path) -> None:
    config = write_config(tmp_path, {
        "model": MODEL,
        "backends": [{"id": "e0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.02}}],
    })
    with run_gateway(config) as gw:

        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int, str]:
            rid, max_tokens = f"client-{i}", 40 + i % 7 * 30
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": max_tokens, "stream": i % 2 == 1}
            want = min(max_tokens, natural_length(rid))
            if not body["stream"]:
                resp = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
                assert resp.status_code == 200, resp.text
                reply = resp.json()
                return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], \
                    expected_text(want)
            async with client.stream("POST", "/v1/chat/completions", json=body | {"stream_options": {
                    "include_usage": True}}, headers={"x-request-id": rid}) as resp:
                assert resp.status_code == 200
                lines = [line async for line in resp.aiter_lines()]
            events = [httpx.Response(200, content=p).json() for p in sse_payloads(iter(lines)) if p != "[DONE]"]
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            return text, events[-1]["usage"]["completion_tokens"], expected_text(want)

        async def run() -> list[tuple[str, int, str]]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=60,
                                         limits=httpx.Limits(max_connections=64)) as client:
                return await asyncio.gather(*(one(client, i) for i in range(160)))

        for i, (text, tokens, want) in enumerate(asyncio.run(run())):
            assert text == want, f"client-{i} got another request's tokens"
            assert tokens == len(want.split()), f"client-{i}"
