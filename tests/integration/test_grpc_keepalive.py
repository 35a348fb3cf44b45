"""The gateway's pings to an idle engine stream, with the keepalive policy both ends take from
common/grpc_keepalive.py, shortened through `HETEROGATE_GRPC_KEEPALIVE_MS` so that the idle gap fits a
test: the gateway pings every second, the stream then stays idle for 6 s (six pings with no data:
a server that accepted pings only every 10 s, or gRPC's default of every 5 minutes, would have
answered GOAWAY "too_many_pings" after the third).

    both ends agree (a gateway and its managed engine)    the request after the gap is served, no GOAWAY
    the engine accepts pings less often than sent          GOAWAY too_many_pings: the gap trips a server
                                                           that does not agree, so the first test would
                                                           see it if the policy were not agreed
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from common.grpc_keepalive import ENV_KEEPALIVE_MS
from gateway.clients.engine_client import EngineClient
from gateway.requests.job import GenerationJob
from testkit.harness import run_gateway, standalone_engines, write_config

MODEL = "llava-1.5-7b"
PING_MS = 1000
IDLE_S = 6.0
GOAWAY = "too_many_pings"

pytestmark = pytest.mark.timeout(90)


def test_an_idle_engine_stream_outlives_the_gateways_pings(tmp_path: Path) -> None:
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.05}}],
    })
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    # the managed engine inherits the gateway's environment, and with it the same policy
    with run_gateway(config, env={ENV_KEEPALIVE_MS: str(PING_MS)}) as gw, gw.client() as client:
        assert client.post("/v1/completions", json=body).status_code == 200   # the Session stream is open
        time.sleep(IDLE_S)
        after = client.post("/v1/completions", json=body)
        log = gw.log_path.read_text(errors="replace")
    assert after.status_code == 200, after.text
    assert GOAWAY not in log
    assert "engine_stream_failed" not in log


def test_an_engine_that_accepts_fewer_pings_cuts_the_idle_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    with standalone_engines(MODEL, tmp_path, heartbeat_ms=100) as engines:
        engines.launch("h100-0", "language", "H100", "--time-scale", "0.05")   # the default policy: 20 s
        address = engines.address("h100-0")
        monkeypatch.setenv(ENV_KEEPALIVE_MS, str(PING_MS))   # this process's client pings every second

        async def idle_stream() -> None:
            client = EngineClient("h100-0", address)
            try:
                job = GenerationJob(request_id="first", prompt="hello", prompt_tokens=3, max_tokens=2)
                stream = client.generate(job, handoff_timeout_s=0, first_token_timeout_s=10, timeout_s=10)
                assert [c async for c in stream][-1].finish_reason
                await asyncio.sleep(IDLE_S)
            finally:
                await client.close()

        asyncio.run(idle_stream())
    assert GOAWAY in capfd.readouterr().err
