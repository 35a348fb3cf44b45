"""Tracing's limits, on the real gateway process (common/tracing.py): a bad batch-processor variable
(`OTEL_BSP_*`) is refused by name at start-up and by `gateway check-config`, as a bad exporter or
sampler is, not a traceback out of the SDK; and a collector that takes connections but never answers
holds the gateway's exit for `SHUTDOWN_S` at most, not the exporter's timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.tracing import SHUTDOWN_S
from testkit.harness import Gateway, free_ports, run_gateway, write_config
from tests.e2e.test_tracing import Upstream

pytestmark = pytest.mark.timeout(120)


def _env(**otel: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **otel}


def _config(tmp: Path, address: str = "http://127.0.0.1:9") -> Path:
    return write_config(tmp, {"model": "llava-1.5-7b", "served_model_name": "mock", "backends": [
        {"id": "up0", "kind": "openai", "role": "language", "gpu": "H100", "address": address}]})


@pytest.mark.parametrize(("variable", "value", "said"), [
    ("OTEL_BSP_SCHEDULE_DELAY", "-5", "'-5' is not a positive whole number"),
    ("OTEL_BSP_SCHEDULE_DELAY", "fast", "'fast' is not a positive whole number"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "0", "'0' is not a positive whole number"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "0", "'0' is not a positive whole number"),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "5000", "5000 is larger than the queue (OTEL_BSP_MAX_QUEUE_SIZE, 2048)"),
    ("OTEL_BSP_EXPORT_TIMEOUT", "1.5", "'1.5' is not a positive whole number"),
])
def test_a_bad_batch_processor_variable_is_refused_by_name_at_start_up_and_by_check_config(
    tmp_path: Path, variable: str, value: str, said: str,
) -> None:
    config, (port, grpc_port) = _config(tmp_path), free_ports(2)
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", **{variable: value})
    gateway = [sys.executable, "-m", "gateway.cli"]
    for args in (["check-config", str(config)],
                 ["--backends", str(config), "--port", str(port), "--grpc-port", str(grpc_port)]):
        out = subprocess.run([*gateway, *args], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.splitlines()[:2] == ["gateway: invalid configuration", f"{variable}: {said}"], out.stderr
        assert "Traceback" not in out.stderr


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """An OTLP endpoint whose connections are taken (the listen backlog) and never answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def _sigterm_exit_s(gw: Gateway) -> float:
    started = time.monotonic()
    gw.process.send_signal(signal.SIGTERM)
    gw.process.wait(timeout=60)
    return time.monotonic() - started


def test_a_collector_that_never_answers_holds_the_exit_for_the_shutdown_bound_only(
    tmp_path: Path, silent_collector: str,
) -> None:
    """The request's spans wait in the queue (a long schedule delay) until the exit exports them: the SDK
    alone waits out the exporter's timeout (10 s) on the silent collector; the gateway gives it SHUTDOWN_S."""
    upstream = Upstream()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": silent_collector, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    try:
        with run_gateway(_config(tmp_path, upstream.url), healthy=0, env=env) as gw:
            gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=2).status_code == 200)
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
                "model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            exit_s = _sigterm_exit_s(gw)
    finally:
        upstream.close()
    assert gw.process.returncode == 0, gw.log_tail()
    assert exit_s < SHUTDOWN_S + 4.0, f"{exit_s:.1f} s from SIGTERM to exit"
