"""What an operator reads, from a real gateway process: `/ready` reports every pool the served
requests need (here the vision pool too: without it the gateway is ready but degraded), every request
is one JSON log line with its status (errors included), library logs are JSON lines too, and /metrics
carries the operating series.

One managed language engine, and a vision backend whose engine the test starts itself, later.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from common import __version__
from testkit.harness import ROOT, Gateway, data_url, free_port, image_bytes, image_part, run_gateway, write_config

MODEL = "llava-1.5-7b"
VISION = "vis-0"
GRPC_CORE_LINE = re.compile(r"^[IWEF]\d{4} ")   # grpc's C core writes its own lines (see common.logs)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, int]]:
    tmp: Path = tmp_path_factory.mktemp("operability")
    vision_port = free_port()
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [
            {"id": "lang-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}},
            {"id": VISION, "role": "vision", "gpu": "L40S", "address": f"127.0.0.1:{vision_port}"},
        ],
    })
    with run_gateway(config, "--log-level", "info", healthy=1) as gw:
        yield gw, vision_port


def log_lines(gw: Gateway) -> list[dict[str, Any]]:
    lines = gw.log_path.read_text(errors="replace").splitlines()
    foreign = [ln for ln in lines if not ln.startswith("{") and not GRPC_CORE_LINE.match(ln)]
    assert not foreign, foreign
    return [orjson.loads(ln) for ln in lines if ln.startswith("{")]


def request_line(gw: Gateway, request_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        found = [ln for ln in log_lines(gw) if ln.get("event") == "request" and ln.get("request_id") == request_id]
        assert len(found) <= 1, found   # once per request
        return found[0] if found else None
    return dict(gw.wait_until(find, timeout=10))


def post(gw: Gateway, request_id: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", content=body, timeout=30,
                      headers={"x-request-id": request_id, "content-type": "application/json"})


def image_chat() -> bytes:
    content = [{"type": "text", "text": "what is this?"}, image_part(data_url(image_bytes()))]
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3})


def test_ready_waits_for_the_vision_pool_and_errors_are_logged(gateway: tuple[Gateway, int]) -> None:
    gw, vision_port = gateway
    ready = httpx.get(f"{gw.url}/ready", timeout=5)   # text is served, images not: degraded, still ready
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "healthy_language_backends": 1, "healthy_vision_backends": 0,
                            "degraded": ["vision"]}

    # While the vision pool is empty an image request is a 503; a malformed body is a 400.
    assert post(gw, "needs-vision", image_chat()).status_code == 503
    assert post(gw, "bad-json", b"{not json").status_code == 400
    for rid, status in (("needs-vision", 503), ("bad-json", 400)):
        line = request_line(gw, rid)
        assert line["status"] == status and line["level"] == "info" and line["error"]
        assert line["endpoint"] == "chat" and "latency_s" in line and "attempts" in line

    engine = subprocess.Popen(
        [sys.executable, "-m", "backends.engine", "--backend-id", VISION, "--role", "vision", "--gpu", "L40S",
         "--model", MODEL, "--gateway", f"127.0.0.1:{gw.grpc_port}", "--port", str(vision_port),
         "--time-scale", "0.1", "--heartbeat-ms", "100", "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=5).json()["healthy_vision_backends"] == 1,
                      timeout=30)
        assert "degraded" not in httpx.get(f"{gw.url}/ready", timeout=5).json()
        resp = post(gw, "with-image", image_chat())
        assert resp.status_code == 200, resp.text
        line = request_line(gw, "with-image")
        assert line["status"] == 200 and line["vision_backends"] == [VISION] and line["backends"] == ["lang-0"]
    finally:
        engine.terminate()
        engine.wait(timeout=15)


def test_a_malformed_request_gets_a_400_and_a_json_log_line(gateway: tuple[Gateway, int]) -> None:
    gw, _ = gateway
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):   # the server closes after its answer
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
    line = gw.wait_until(lambda: next((ln for ln in log_lines(gw) if ln.get("event") == "invalid_http_request"),
                                      None), timeout=10)
    assert line["level"] == "warning" and "timestamp" in line


def test_library_logs_are_json_lines() -> None:
    """A library logging through the standard `logging` module comes out in the same JSON lines."""
    code = ("from common.logs import configure_logging; configure_logging('info'); import logging; "
            "logging.getLogger('some.library').warning('disk %s', 'full')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    line = orjson.loads(done.stderr.strip().splitlines()[-1])
    assert line["logger"] == "some.library" and line["level"] == "warning" and line["event"] == "disk full"
    assert "timestamp" in line


def test_metrics_carry_the_operating_series(gateway: tuple[Gateway, int]) -> None:
    gw, _ = gateway
    ok = post(gw, "counted", orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 3}))
    assert ok.status_code == 200
    text = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert "_created" not in text
    assert 'heterogate_build_info{python="' in text and f'version="{__version__}"' in text
    assert re.search(r'^heterogate_generation_tokens_total\{backend="lang-0"\} [1-9]', text, re.M)
    assert re.search(r'^heterogate_prompt_tokens_total\{backend="lang-0"\} [1-9]', text, re.M)
    assert re.search(r"^heterogate_admission_queue_waiting 0\.0$", text, re.M)
    assert re.search(r'^heterogate_backend_heartbeat_age_seconds\{backend="lang-0",', text, re.M)
    assert re.search(r'^heterogate_backend_restarts_total\{backend="lang-0",[^}]*\} 0\.0$', text, re.M)
    assert "process_cpu_seconds_total" in text and "process_resident_memory_bytes" in text
    assert re.search(r'^heterogate_requests_total\{backend="lang-0",endpoint="chat",model="[^"]+",policy="\w+",'
                     r'status="200"\}',
                     text, re.M)
