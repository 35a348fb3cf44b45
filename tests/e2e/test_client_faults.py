"""What a client does is never held against a backend: requests whose own `x-request-timeout` passes
(0.001 s) and clients that leave mid-request, many in a row, open no breaker, and normal requests are
served after them.

Real processes on 127.0.0.1: a gateway with two managed simulated engines whose clock runs 20x slow
(a token every ~0.1-0.15 s), so that deadlines and disconnects land mid-generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Gateway, run_gateway, write_config

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

