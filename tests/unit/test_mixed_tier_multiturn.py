"""The live multiturn benchmark's client: each turn resends the conversation with the reply it really received.

A stub engine answers every turn with text of its own (a different reply each time) and records what
it was sent; turn k+1 must be the system prompt, every earlier user message and the streamed reply
text received for each, then the next user message.
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from benchmarks.mixed_tier_multiturn import converse
from benchmarks.prefix_affinity import conversations, tenants


async def test_each_turn_carries_the_history_and_the_replies_received() -> None:
    sent: list[list[dict[str, str]]] = []
    counter = itertools.count()

    async def chat(request: web.Request) -> web.StreamResponse:
        payload: dict[str, Any] = await request.json()
        sent.append(payload["messages"])
        n = next(counter)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(payload["max_tokens"]):
            event = {"system_fingerprint": "stub-0", "choices": [{"index": 0, "delta": {"content": f"r{n}w{k} "}}]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
    try:
        c = conversations("multiturn", 1, 1.0, 5, tenants(5, 2))[0]
        c.start_s, c.thinks = 0.0, [0.0] * len(c.turns)
        outcomes: list[Any] = []
        async with aiohttp.ClientSession() as session:
            await converse(session, f"http://127.0.0.1:{port}/v1/chat/completions", c, 0.0, 1.0, outcomes)
    finally:
        await runner.cleanup()

    assert len(sent) == len(outcomes) == c.sent >= 3   # every turn the context allowed, none failed
    assert all(not o.error and o.engine == "stub-0" for o in outcomes)
    for k, messages in enumerate(sent):
        assert messages[0] == {"role": "system", "content": c.system}
        assert messages[-1] == {"role": "user", "content": c.turns[k][0]}
        history = messages[1:-1]
        assert [m["role"] for m in history] == ["user", "assistant"] * k
        for j in range(k):
            assert history[2 * j]["content"] == c.turns[j][0]
            reply = "".join(f"r{j}w{w} " for w in range(c.turns[j][1]))   # what the stub streamed for turn j
            assert history[2 * j + 1]["content"] == reply == outcomes[j].text
