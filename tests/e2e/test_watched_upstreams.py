"""A `kind: openai` backend has no agent unless its entry says `agent: true`: on the gateway's open
loopback control port a heartbeat for one is refused (PERMISSION_DENIED), so nobody can advertise a
million-token context for it; an `agent: true` one takes them. A real gateway and the fake upstream."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from common.errors import ConfigError
from common.wire import control_pb2, control_pb2_grpc
from gateway.config.cluster import load_cluster
from testkit.harness import free_port, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"
pytestmark = pytest.mark.timeout(120)


async def heartbeat(port: int, backend_id: str, address: str, max_model_len: int) -> control_pb2.GatewayMessage:
    """One heartbeat with no credentials; the gateway's ack, or its AioRpcError."""
    async def one() -> AsyncIterator[control_pb2.BackendState]:
        yield control_pb2.BackendState(backend_id=backend_id, address=address, seq=time.monotonic_ns(),
                                       max_model_len=max_model_len)
        await asyncio.Event().wait()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        async for ack in control_pb2_grpc.ControlStub(channel).Connect(one(), timeout=10):
            return ack
    raise AssertionError("no ack")


def test_heartbeats_for_a_watched_upstream_are_refused_and_an_agents_are_taken(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100}, "backends": [
        {"id": "watched", "kind": "openai", "gpu": "L40S", "address": url},
        {"id": "with-agent", "kind": "openai", "gpu": "L40S", "address": url, "agent": True},
    ]})
    try:
        with run_gateway(config, healthy=0, timeout=60) as gw:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                asyncio.run(heartbeat(gw.grpc_port, "watched", url, 1_000_000))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "agent: true" in (refused.value.details() or "")
            watched = gw.backend("watched")
            assert (watched["max_model_len"], watched["context_source"]) == (4096, "catalog")
            models = httpx.get(f"{gw.url}/v1/models", timeout=5).json()["data"][0]
            assert models["max_model_len"] == 4096
            asyncio.run(heartbeat(gw.grpc_port, "with-agent", url, 8192))   # its agent: taken
            assert gw.backend("with-agent")["max_model_len"] == 8192
    finally:
        stop(upstream)


@pytest.mark.parametrize(("entry", "named"), [
    ("{id: u, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000', agent: true, scrape: {engine: vllm}}",
     "`agent: true` is for an engine the gateway neither scrapes nor launches"),
    ("{id: u, kind: openai, gpu: H100, agent: true, launch: {command: 'vllm serve m --port {port}'}}",
     "`agent: true` is for an engine the gateway neither scrapes nor launches"),
    ("{id: e, gpu: H100, address: '10.0.0.5:7000', agent: true}", "`agent` apply to kind: openai backends only"),
])
def test_agent_entries_that_make_no_sense_are_config_errors(tmp_path: Path, entry: str, named: str) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(f"model: {MODEL}\nbackends:\n  - {entry}\n")
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_cluster(path)
