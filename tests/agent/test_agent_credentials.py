"""The agent as a real process against a control port that wants the cluster token over TLS: with
`--token-file` and `--ca-file` its heartbeats land; without the token the gateway refuses it (and the
agent says so in its log); an unreadable token file stops the agent naming the flag."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.wire import control_pb2_grpc
from gateway.control.control_auth import ControlAuth
from gateway.control.heartbeat_service import ControlService
from gateway.routing.signals import LocalSignals
from gateway.routing.state_table import StateTable
from testkit.harness import ROOT
from tests.agent.test_agent_heartbeats import GPU, MODEL, MetricsEndpoint, endpoint, vllm_text, wait_for
from tests.tls_certs import self_signed

__all__ = ["endpoint"]   # the fixture, shared with test_agent_heartbeats
pytestmark = pytest.mark.timeout(60)
TOKEN = "agent-cluster-token"


@pytest.fixture
async def tls_gateway(tmp_path: Path) -> AsyncIterator[tuple[StateTable, str, Path]]:
    """A Control service over TLS that wants the cluster token; one external backend, `ext-0`."""
    cert, key = self_signed(tmp_path)
    table = StateTable(MODEL, heartbeat_interval_s=0.1)
    table.register("ext-0", "language", GPU, address=None, managed=False)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(table), auth=ControlAuth(TOKEN)), server)
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    yield table, f"127.0.0.1:{port}", cert
    await server.stop(grace=None)


def agent(tmp: Path, name: str, metrics: MetricsEndpoint, gateway: str, *extra: str) -> tuple[
    subprocess.Popen[bytes], Path
]:
    log_path = tmp / f"agent-{name}.log"
    cmd = [sys.executable, "-m", "backends.agent", "--engine", "vllm", "--metrics-url", f"{metrics.url}/metrics",
           "--address", metrics.url, "--backend-id", "ext-0", "--gpu", "H100", "--model", "llava-1.5-7b",
           "--gateway", gateway, "--interval-ms", "100", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROGATE_")}
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), log_path


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_agent_with_token_and_ca_is_heard_and_without_is_refused(
    tmp_path: Path, endpoint: MetricsEndpoint, tls_gateway: tuple[StateTable, str, Path]
) -> None:
    table, address, cert = tls_gateway
    entry = table.get("ext-0")
    assert entry is not None
    endpoint.body = vllm_text([(2, 1, 0.5)])
    anonymous, anonymous_log = agent(tmp_path, "anonymous", endpoint, address, "--ca-file", str(cert))
    plaintext, plaintext_log = agent(tmp_path, "plaintext", endpoint, address, "--log-level", "debug")
    try:
        await wait_for(lambda: "UNAUTHENTICATED" in anonymous_log.read_text(errors="replace"), 20,
                       "the gateway refuses an agent without the token", anonymous_log)
        assert entry.last_heartbeat is None and entry.address is None
        await asyncio.sleep(1.5)   # retried with backoff meanwhile, five times or so
        # said once (it was an error line at every retry), until the reason changes or a stream lands
        assert anonymous_log.read_text(errors="replace").count("gateway_rejected_backend") == 1
        # without the CA, a TLS port only drops the handshake: the agent says what that may mean
        await wait_for(lambda: "a TLS control port? give its CA (--ca-file)" in plaintext_log.read_text(
            errors="replace"), 20, "a plaintext agent at a TLS port is given the hint", plaintext_log)
    finally:
        stop(anonymous)
        stop(plaintext)
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    trusted, log = agent(tmp_path, "trusted", endpoint, address, "--token-file", str(tmp_path / "token"),
                         "--ca-file", str(cert))
    try:
        await wait_for(lambda: entry.last_heartbeat is not None, 20, "heartbeats with the token over TLS", log)
        assert entry.address == endpoint.url and entry.reported.waiting == 2
    finally:
        stop(trusted)


def test_unreadable_token_file_stops_the_agent(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "backends.agent", "--engine", "vllm", "--address", "http://127.0.0.1:1",
           "--backend-id", "ext-0", "--gpu", "H100", "--model", "llava-1.5-7b", "--gateway", "127.0.0.1:1",
           "--token-file", str(tmp_path / "absent")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--token-file: cannot read" in proc.stderr
