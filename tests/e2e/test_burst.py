"""A burst of 200 concurrent mixed requests against the default demo cluster: no errors, spread, drained."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from testkit.harness import Gateway, wait_all_healthy

MODEL = "llava-1.5-7b"
BURST = 200

pytestmark = pytest.mark.timeout(90)


@dataclass(frozen=True)
class Shape:
    endpoint: str          # "chat" | "completions"
    stream: bool
    prompt_words: int
    max_tokens: int | None  # None: the engine's natural stop, within default_max_tokens


@dataclass
class Outcome:
    shape: Shape
    status: int
    backend: str
    request_id: str
    text: str
    finish_reason: str | None
    completion_tokens: int | None
    errors: list[str]


def shapes(n: int, seed: int = 7) -> list[Shape]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        long_prompt = i % 4 == 0   # ~1,500 prompt tokens; the rest a handful
        out.append(Shape(
            endpoint="chat" if i % 2 == 0 else "completions",
            stream=(i // 2) % 2 == 0,
            prompt_words=rng.randint(1000, 1200) if long_prompt else rng.randint(3, 40),
            max_tokens=None if i % 10 == 3 else rng.choice([1, 4, 16, 48]),
        ))
    return out


def body(shape: Shape, i: int) -> tuple[str, dict[str, Any]]:
    text = " ".join(f"w{(i + k) % 97}" for k in range(shape.prompt_words))
    req: dict[str, Any] = {"model": MODEL, "stream": shape.stream}
    if shape.max_tokens is not None:
        req["max_tokens"] = shape.max_tokens
    if shape.stream:
        req["stream_options"] = {"include_usage": True}
    if shape.endpoint == "chat":
        req["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        return "/v1/chat/completions", req
    req["prompt"] = text
    return "/v1/completions", req


async def one(client: httpx.AsyncClient, shape: Shape, i: int) -> Outcome:
    path, req = body(shape, i)
    rid = f"burst-{i}"
    headers = {"x-request-id": rid}
    if not shape.stream:
        r = await client.post(path, json=req, headers=headers)
        data = r.json()
        if r.status_code != 200:
            return Outcome(shape, r.status_code, "", rid, "", None, None, [r.text])
        choice = data["choices"][0]
        text = choice["message"]["content"] if shape.endpoint == "chat" else choice["text"]
        return Outcome(shape, 200, r.headers["x-heterogate-backend"], r.headers["x-request-id"], text,
                       choice["finish_reason"], data["usage"]["completion_tokens"], [])
    async with client.stream("POST", path, json=req, headers=headers) as r:
        if r.status_code != 200:
            return Outcome(shape, r.status_code, "", rid, "", None, None, [(await r.aread()).decode()])
        text, finish, used, errors, done = "", None, None, [], False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if done:
                errors.append(f"event after [DONE]: {payload}")
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                errors.append(payload)
                continue
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if shape.endpoint == "chat" else choice["text"]
                finish = choice["finish_reason"] or finish
        if not done:
            errors.append("stream ended without [DONE]")
        return Outcome(shape, 200, r.headers["x-heterogate-backend"], r.headers["x-request-id"], text, finish,
                       used, errors)


async def burst(url: str, plan: list[Shape]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    timeout = httpx.Timeout(connect=10, read=60, write=10, pool=30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        return await asyncio.gather(*(one(client, s, i) for i, s in enumerate(plan)))


def test_burst_of_mixed_requests(demo_gateway: Gateway) -> None:
    backends = wait_all_healthy(demo_gateway)
    gpu_of = {b["id"]: b["gpu"] for b in backends}
    plan = shapes(BURST)
    assert {(s.endpoint, s.stream) for s in plan} == {(e, st) for e in ("chat", "completions") for st in (True, False)}

    outcomes = asyncio.run(burst(demo_gateway.url, plan))

    failed = [o for o in outcomes if o.status != 200 or o.errors]
    assert not failed, [(o.request_id, o.status, o.errors) for o in failed[:5]]
    for i, o in enumerate(outcomes):
        assert o.request_id == f"burst-{i}"
        assert o.backend in gpu_of, o.backend
        assert o.text, o
        assert o.finish_reason in {"stop", "length"}, o
        limit = o.shape.max_tokens
        assert o.completion_tokens is not None and 1 <= o.completion_tokens <= (limit or 256), o
        if limit is not None and o.completion_tokens < limit:
            assert o.finish_reason == "stop", o
    types = Counter(gpu_of[o.backend] for o in outcomes)
    assert len(types) > 1, f"the whole burst went to one GPU type: {types}"

    def drained() -> bool:
        return all(b["in_flight"] == 0 and b["running"] == 0 and b["waiting"] == 0 for b in demo_gateway.backends())

    demo_gateway.wait_until(drained, timeout=10)
    assert all(b["healthy"] for b in demo_gateway.backends())
