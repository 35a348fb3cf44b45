"""What an operator reads: `/admin/backends` pids, the request log lines of a replica, `gateway --version`.

One gateway replica (on the Redis at 127.0.0.1:6379, a fresh key prefix) in front of a managed
engine and of a `kind: openai` backend it scrapes (tests/fake_openai_server.py):

    /admin/backends       the engine's own pid for the managed engine; none for the scraped backend
                          (its metrics do not say, and the scraper's pid is the gateway's own)
    request log lines     every one names the replica that served it: HTTP, streamed or not, a 400,
                          and the gRPC door
    gateway --version     printed with none of the gateway's modules (nor grpc, pydantic, ...) imported
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import orjson
import pytest

from common import __version__
from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config
from tests.e2e.test_external_engines import MODEL, spawn, stop
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix

pytestmark = pytest.mark.timeout(120)


def requests_sent(gw: Gateway) -> int:
    """One request through each door and outcome; returns how many were sent."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with gw.client() as c:
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}).status_code == 400
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        request = inference_pb2.GenerateRequest(model=MODEL, prompt="Once", max_tokens=2)
        assert list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30))
    return 4


def test_admin_pids_and_the_replica_on_every_request_line(tmp_path: Path) -> None:
    port = free_port()
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    try:
        with redis_prefix("views") as prefix:
            config = write_config(tmp_path, {
                "model": MODEL,
                "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20, "redis": {"key_prefix": prefix}},
                "backends": [
                    {"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.05}},
                    {"id": "scraped", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{port}",
                     "scrape": {"engine": "vllm", "interval_ms": 100}},
                ],
            })
            with run_gateway(config, "--redis-url", SYSTEM_REDIS, "--log-level", "info", timeout=60) as gw:
                scraped, engine = gw.backend("scraped"), gw.backend("h100-0")
                engine_argv = Path(f"/proc/{engine['pid']}/cmdline").read_bytes().split(b"\0")
                sent = requests_sent(gw)
                lines = [orjson.loads(line) for line in gw.log_path.read_bytes().splitlines()
                         if line.startswith(b"{")]
    finally:
        stop(upstream)
    assert scraped["pid"] is None
    assert b"backends.engine" in engine_argv and b"h100-0" in engine_argv   # the engine's own
    replica = next(line["replica"] for line in lines if line["event"] == "gateway_starting")
    assert replica and f"-{gw.process.pid}-" in replica
    requests = [line for line in lines if line["event"] == "request"]
    assert len(requests) >= sent
    assert {line.get("replica") for line in requests} == {replica}


def test_version_is_printed_without_loading_the_gateway() -> None:
    script = shutil.which("gateway", path=str(Path(sys.executable).parent))   # the console script
    assert script is not None
    run = subprocess.run([sys.executable, "-X", "importtime", script, "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == f"heterogate {__version__}\n"
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "gateway.cli" in imported
    heavy = {"gateway.daemon", "gateway.config.cluster", "gateway.routing.policies", "common.logs", "grpc",
             "pydantic", "structlog", "httpx", "redis", "yaml", "numpy"}
    assert not heavy & imported, sorted(heavy & imported)
