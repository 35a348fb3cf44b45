"""A pool whose every backend's heartbeats are late is still served: a request goes to the backends
heard from within `gateway.heartbeat_fail_open_s` and waits for them, instead of an immediate 503.

On a busy host a lone engine's heartbeats can arrive past the miss limit (3 x 200 ms by default) for a
moment; with no other backend of its role to take the request, a 503 loses a request the engine would
have served a moment later. Real processes on 127.0.0.1: a gateway with one managed simulated language
engine and one vision engine, each stopped with SIGSTOP while a request is sent, then let go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.harness import (
    Gateway,
    data_url,
    engine_pid,
    image_bytes,
    image_part,
    run_gateway,
    sigstopped,
    text_part,
    wait_all_healthy,
    write_config,
)
from tests.e2e.test_deadlines import request_line

MODEL = "llava-1.5-7b"
FAIL_OPEN_S = 3.0     # the window under test
STOPPED_S = 0.8       # past the miss limit (3 x 100 ms), inside the window


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("late_heartbeats")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_fail_open_s": FAIL_OPEN_S,
                    "stealing": {"enabled": False}},
        "backends": [{"id": "lang", "gpu": "H100", "launch": {"time_scale": 0.05}},
                     {"id": "enc", "role": "vision", "gpu": "L4", "launch": {"time_scale": 0.05}}],
    })
    with run_gateway(config, "--log-level", "info") as gateway:
        yield gateway


def _chat(content: object) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def _send_while_stopped(gw: Gateway, backend_id: str, body: dict[str, object], request_id: str,
                        stopped_s: float) -> httpx.Response:
    """Stop the backend's engine, wait until the gateway marks it unhealthy, send the request, let the
    engine go `stopped_s` after it was stopped; the request's answer."""
    pid = engine_pid(gw, backend_id)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=gw.url, timeout=20.0) as client:
            with sigstopped(pid):
                stopped = time.monotonic()
                await asyncio.to_thread(gw.wait_until, lambda: not gw.backend(backend_id)["healthy"], 5)
                sent = asyncio.create_task(client.post("/v1/chat/completions", json=body,
                                                       headers={"x-request-id": request_id}))
                await asyncio.sleep(max(0.0, stopped + stopped_s - time.monotonic()))
                assert not sent.done(), sent.result().text   # it waits for the engine, no 503
            return await sent

    return asyncio.run(run())


def test_a_lone_language_engine_with_late_heartbeats_still_serves(gw: Gateway) -> None:
    wait_all_healthy(gw)
    answer = _send_while_stopped(gw, "lang", _chat("a question while the engine is late"),
                                 "late-text", STOPPED_S)
    assert answer.status_code == 200, answer.text
    assert request_line(gw, "late-text")["backends"] == ["lang"]   # one attempt: not cancelled as unhealthy


def test_a_lone_encoder_with_late_heartbeats_still_encodes(gw: Gateway) -> None:
    wait_all_healthy(gw)
    content = [text_part("what is in this picture?"), image_part(data_url(image_bytes()))]
    answer = _send_while_stopped(gw, "enc", _chat(content), "late-image", STOPPED_S)
    assert answer.status_code == 200, answer.text
    assert request_line(gw, "late-image")["vision_backends"] == ["enc"]


def test_past_the_window_a_silent_pool_gets_503_at_once(gw: Gateway) -> None:
    wait_all_healthy(gw)
    with sigstopped(engine_pid(gw, "lang")):
        time.sleep(FAIL_OPEN_S + 0.5)
        started = time.monotonic()
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("anyone there?"), timeout=20.0)
        waited = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "no_backend_available", answer.text
    assert waited < 2.0, waited
    gw.wait_until(lambda: gw.backend("lang")["healthy"], timeout=20)
