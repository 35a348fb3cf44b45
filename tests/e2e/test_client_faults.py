"""What a client does is never held against a backend, and the request log tells what it got.

- Requests whose own `x-request-timeout` passes (0.001 s) and clients that leave mid-request, many in
  a row, open no breaker: normal requests are served after them by every backend.
- A client that leaves after N streamed tokens is logged with the tokens it was sent; a request whose
  deadline passes after tokens flowed is logged with its prompt and completion tokens; a non-streamed
  request whose deadline passes mid-generation logs no restart (nothing restarts).

Real processes on 127.0.0.1: a gateway with two managed simulated engines whose clock runs 20x slow
(a token every ~0.1-0.15 s), so that deadlines and disconnects land mid-generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from testkit.harness import Gateway, long_request_id, run_gateway, sse_payloads, write_config
from tests.e2e.test_deadlines import request_line

MODEL = "llava-1.5-7b"
BACKENDS = ["h100-0", "a100-0"]
IMPATIENT = 200       # requests with a 1 ms deadline
LEAVERS = 40          # streamed requests whose client goes before the first token


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("client_faults")
    launch = {"time_scale": 20.0}
    config = write_config(tmp, {
        "model": MODEL,
        "backends": [{"id": "h100-0", "gpu": "H100", "launch": launch},
                     {"id": "a100-0", "gpu": "A100-80GB", "launch": launch}],
    })
    with run_gateway(config, "--log-level", "info") as gateway:
        yield gateway


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def log_events(gw: Gateway, event: str) -> list[dict[str, Any]]:
    lines = gw.log_records()
    return [ln for ln in lines if ln.get("event") == event]


def test_clients_own_deadlines_and_departures_open_no_breaker(gw: Gateway) -> None:
    async def impatient(client: httpx.AsyncClient, i: int) -> int:
        resp = await client.post("/v1/chat/completions", json=chat(f"in a hurry {i}", max_tokens=8, stream=i % 2 == 0),
                                 headers={"x-request-timeout": "0.001"})
        return resp.status_code

    async def leaves(client: httpx.AsyncClient, i: int) -> None:
        try:
            async with asyncio.timeout(0.05):   # gone long before its first token (~0.3 s at this clock)
                await client.post("/v1/chat/completions", json=chat(f"changed my mind {i}", max_tokens=8))
        except TimeoutError:
            pass

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            statuses = [s for batch in range(IMPATIENT // 20)
                        for s in await asyncio.gather(*(impatient(client, batch * 20 + i) for i in range(20)))]
            await asyncio.gather(*(leaves(client, i) for i in range(LEAVERS)))
            return statuses

    statuses = asyncio.run(run())
    # Their own deadline, never a 503: a 504, or for a stream whose first token beat the deadline, its
    # 200 and then the 504 as an error event.
    assert set(statuses) <= {200, 504} and statuses.count(504) >= IMPATIENT // 2, sorted(set(statuses))
    backends = gw.backends()
    assert {b["id"]: b["breaker"] for b in backends} == dict.fromkeys(BACKENDS, "closed")
    assert all(b["healthy"] for b in backends)
    gw.wait_until(lambda: all(b["in_flight"] == 0 for b in gw.backends()), timeout=20)
    with gw.client() as client:
        for i in range(10):
            resp = client.post("/v1/chat/completions", json=chat(f"normal {i}", max_tokens=2))
            assert resp.status_code == 200, resp.text


def test_a_client_leaving_mid_stream_is_logged_with_the_tokens_it_was_sent(gw: Gateway) -> None:
    rid = long_request_id(200, prefix="leaves-midstream")
    read = 0
    with gw.client() as client, client.stream("POST", "/v1/chat/completions", headers={"x-request-id": rid},
                                              json=chat("tell me a story", max_tokens=256, stream=True)) as resp:
        assert resp.status_code == 200
        for payload in sse_payloads(resp.iter_lines()):
            if orjson.loads(payload)["choices"][0]["delta"].get("content"):
                read += 1
            if read == 10:
                break   # and the connection closes
    line = request_line(gw, rid)
    assert line["status"] == 499
    assert 10 <= line["completion_tokens"] < 200 and line["prompt_tokens"] > 0, line


def test_a_deadline_after_tokens_flowed_logs_the_tokens(gw: Gateway) -> None:
    rid = long_request_id(200, prefix="streams-past-deadline")
    with gw.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=chat("tell me a story", max_tokens=256, stream=True),
        headers={"x-request-id": rid, "x-request-timeout": "1.5"},
    ) as resp:
        assert resp.status_code == 200
        payloads = list(sse_payloads(resp.iter_lines()))
    assert payloads[-1] == "[DONE]" and "error" in orjson.loads(payloads[-2]), payloads[-3:]
    assert orjson.loads(payloads[-2])["error"]["code"] == "deadline_exceeded"   # the client's, not the backend's
    tokens = sum(1 for p in payloads[:-2] if orjson.loads(p)["choices"][0]["delta"].get("content"))
    line = request_line(gw, rid)
    assert line["status"] == 504 and tokens >= 1
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] >= tokens, line


def test_a_non_streamed_deadline_mid_generation_restarts_nothing(gw: Gateway) -> None:
    rid = long_request_id(200, prefix="whole-past-deadline")
    with gw.client() as client:
        resp = client.post("/v1/chat/completions", json=chat("tell me a story", max_tokens=256),
                           headers={"x-request-id": rid, "x-request-timeout": "1.5"})
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "deadline_exceeded"
    line = request_line(gw, rid)
    assert line["status"] == 504 and line["attempts"] == 1
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] >= 1, line   # its first token came
    assert not [e for e in log_events(gw, "restarting_after_midstream_failure") if e.get("request_id") == rid]
