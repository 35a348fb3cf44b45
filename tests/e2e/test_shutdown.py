"""SIGTERM on a real gateway with requests under way on both doors: within `gateway.drain_timeout_s` they
finish; past it each is told why it ends (a 503, an error event and [DONE] on a stream, UNAVAILABLE on the
gRPC door, all `gateway_shutting_down`), and none is logged as a client's disconnect or a backend's fault."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, run_gateway, sse_payloads, write_config

MODEL = "llava-1.5-7b"


def cluster(tmp: Path, drain_s: float) -> Path:
    # time_scale 20: a token every ~0.1-0.2 s, so a long answer outlasts a short drain
    return write_config(tmp, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
                                                          "drain_timeout_s": drain_s},
                              "backends": [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 20.0}}]})


class Clients:
    """One streamed and one whole HTTP request and one gRPC stream, each in its own thread; `started` is
    set once the streams have their first token and the whole request is under way."""

    def __init__(self, gw: Gateway, max_tokens: int, grpc_tokens: int) -> None:
        self.results: dict[str, Any] = {}
        self._grpc_tokens = grpc_tokens
        self._streams_started = threading.Barrier(3)
        self.started = threading.Event()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": max_tokens}
        self.threads = [threading.Thread(target=t, args=(gw, body), daemon=True)
                        for t in (self._http_stream, self._http_whole, self._grpc_stream)]
        for t in self.threads:
            t.start()
        self._streams_started.wait(timeout=30)
        # the whole request has nothing to wait on: it is under way once the engine holds all three
        gw.wait_until(lambda: gw.backend("h100-0")["in_flight"] >= 3, timeout=30, interval=0.02)
        self.started.set()

    def join(self) -> dict[str, Any]:
        for t in self.threads:
            t.join(timeout=60)
        return self.results

    def _http_stream(self, gw: Gateway, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            payloads = []
            for payload in sse_payloads(r.iter_lines()):
                payloads.append(payload)
                if len(payloads) == 1:
                    self._streams_started.wait(timeout=30)
            self.results["http_stream"] = payloads

    def _http_whole(self, gw: Gateway, body: dict[str, Any]) -> None:
        self.results["http_whole"] = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)

    def _grpc_stream(self, gw: Gateway, body: dict[str, Any]) -> None:
        async def call() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                request = inference_pb2.GenerateRequest(model=MODEL, prompt="tell me a story",
                                                        max_tokens=self._grpc_tokens)
                replies = []
                try:
                    async for reply in stub.Generate(request, timeout=60):
                        replies.append(reply)
                        if len(replies) == 1:
                            await asyncio.to_thread(self._streams_started.wait, 30)
                except grpc.aio.AioRpcError as exc:
                    self.results["grpc_error"] = (exc.code(), exc.details())
                self.results["grpc_stream"] = replies
        asyncio.run(call())


def stop(gw: Gateway) -> int:
    gw.process.send_signal(signal.SIGTERM)
    return gw.process.wait(timeout=60)


def grpc_health(gw: Gateway) -> int:
    async def check() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)
    return asyncio.run(check())


def test_requests_under_way_finish_within_the_drain(tmp_path: Path) -> None:
    """... and the gRPC health service says NOT_SERVING from the drain's start, so balancers stop sending."""
    with run_gateway(cluster(tmp_path, drain_s=30)) as gw:
        clients = Clients(gw, max_tokens=8, grpc_tokens=30)   # the gRPC stream outlasts the HTTP requests
        assert grpc_health(gw) == health_pb2.HealthCheckResponse.SERVING
        gw.process.send_signal(signal.SIGTERM)
        gw.wait_until(lambda: grpc_health(gw) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
        assert gw.process.wait(timeout=60) == 0
        results = clients.join()
    assert results["http_stream"][-1] == "[DONE]"
    # finished (a simulated engine stops some answers before max_tokens: "stop"), not cut
    assert orjson.loads(results["http_stream"][-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert results["http_whole"].status_code == 200
    assert "grpc_error" not in results and results["grpc_stream"][-1].finish_reason in ("stop", "length")


@pytest.mark.timeout(120)
def test_past_the_drain_every_request_is_told_the_gateway_is_shutting_down(tmp_path: Path) -> None:
    with run_gateway(cluster(tmp_path, drain_s=1), "--log-level", "info") as gw:
        clients = Clients(gw, max_tokens=2000, grpc_tokens=2000)
        assert stop(gw) == 0
        results = clients.join()
        log = [orjson.loads(line) for line in gw.log_path.read_bytes().splitlines() if line.startswith(b"{")]
    assert results["http_stream"][-1] == "[DONE]"
    assert orjson.loads(results["http_stream"][-2])["error"]["code"] == "gateway_shutting_down"
    whole = results["http_whole"]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "gateway_shutting_down", whole.text
    code, details = results["grpc_error"]
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    statuses = [line["status"] for line in log if line.get("event") == "request"]
    assert statuses == [503, 503, 503], statuses
