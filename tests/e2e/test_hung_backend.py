"""A backend that hangs (its engine stopped with SIGSTOP) does not hold the requests waiting on it for
their first token: once the gateway marks it unhealthy (missed heartbeats), each of them is retried on
another backend at once, while the engine is still stopped.

Real processes on 127.0.0.1: a gateway with two managed simulated engines, `slow` (its clock 100x
slow: a long prompt takes seconds to prefill, so the requests sent to it are still waiting for their
first token when it is stopped) and `fast`. Round robin sends every other request to `slow`. The
first-token limit is put out of the way (its floor at the first-token timeout), so only the health
watch can take the requests off `slow` before the client gives up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, engine_pid, run_gateway, sigstopped, wait_all_healthy, write_config
from tests.e2e.test_deadlines import request_line

MODEL = "llava-1.5-7b"
REQUESTS = 6
CLIENT_TIMEOUT_S = 30.0   # far below the 60 s first-token timeout: only leaving `slow` early answers in time


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("hung_backend")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "retry_backoff_s": 0.001,
                    "routing": {"policy": "round_robin"},
                    "limits": {"first_token_timeout_s": 60, "first_token_floor_s": 60}},
        "backends": [{"id": "slow", "gpu": "H100", "launch": {"time_scale": 100.0}},
                     {"id": "fast", "gpu": "H100", "launch": {"time_scale": 0.05}}],
    })
    with run_gateway(config, "--log-level", "info") as gateway:
        yield gateway


def test_requests_waiting_on_a_stopped_engine_are_retried_elsewhere(gw: Gateway) -> None:
    wait_all_healthy(gw)
    prompt = " ".join(["word"] * 2000)   # ~3 s of prefill on `slow`

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/v1/chat/completions", headers={"x-request-id": f"hung-{i}"},
                                 json={"model": MODEL, "max_tokens": 4, "stream": i % 2 == 1,
                                       "messages": [{"role": "user", "content": f"request {i}: {prompt}"}]})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
            sent = [asyncio.create_task(one(client, i)) for i in range(REQUESTS)]

            def waiting_on_slow() -> bool:
                slow = gw.backend("slow")
                return bool(slow["in_flight"] and slow["prefilling"] == slow["in_flight"])

            await asyncio.to_thread(gw.wait_until, waiting_on_slow, 10)
            with sigstopped(engine_pid(gw, "slow")):
                answers = await asyncio.gather(*sent)
                assert not gw.backend("slow")["healthy"]   # still stopped as the answers came
            return answers

    answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200] * REQUESTS, [r.text for r in answers if r.status_code != 200]
    lines = [request_line(gw, f"hung-{i}") for i in range(REQUESTS)]
    moved = [ln for ln in lines if ln["backends"][0] == "slow"]
    assert moved, lines
    assert all(ln["backends"] == ["slow", "fast"] and ln["status"] == 200 for ln in moved), moved
    gw.wait_until(lambda: gw.backend("slow")["healthy"], timeout=20)   # back once it runs again
