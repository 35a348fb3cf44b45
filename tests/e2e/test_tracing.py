"""OpenTelemetry tracing end to end: real gateway and engine processes export to an OTLP/HTTP receiver
on 127.0.0.1 (tests/otlp_collector.py), and one request's spans form the documented tree
(gateway/pipeline/tracing.py): under the client's traceparent, the request's span; under it the routing
decision and the attempt; under the attempt the first token, the stream, the images' encode, and the
spans of the engines that served it (backends/engine_tracing.py). A `kind: openai` upstream receives the
attempt's traceparent as an HTTP header, and one for a request the sampler left out too (flag off).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import (
    Gateway,
    data_url,
    image_bytes,
    image_part,
    metric_total,
    run_gateway,
    text_part,
    write_config,
)
from tests.otlp_collector import Collector, ReceivedSpan, otlp_collector

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TOKENS = 6


class Upstream:
    """A small OpenAI-compatible engine that keeps the traceparent header of every completion it serves."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        self.tracestates: list[str | None] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:   # the gateway's probe
                self._send(json.dumps({"object": "list", "data": [{"id": "mock", "max_model_len": 4096}]}).encode(),
                           "application/json")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                upstream.traceparents.append(self.headers.get("traceparent"))
                upstream.tracestates.append(self.headers.get("tracestate"))
                n = int(request.get("max_tokens") or TOKENS)
                base = {"id": "up-1", "model": "mock", "created": 0}
                if not request.get("stream"):
                    self._send(json.dumps({**base, "object": "chat.completion", "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": "x" * n}, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}).encode(),
                        "application/json")
                    return
                events = [{**base, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": "x"}, "finish_reason": "length" if i == n - 1 else None}]}
                    for i in range(n)]
                events.append({**base, "object": "chat.completion.chunk", "choices": [],
                               "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
                body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                self._send(body, "text/event-stream")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def tracing_env(endpoint: str) -> dict[str, str]:
    """Tracing on, exported to `endpoint` every 50 ms (engines launched by the gateway inherit it)."""
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    with otlp_collector() as received:
        yield received


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    try:
        yield up
    finally:
        up.close()


@pytest.fixture(scope="module")
def openai_gw(tmp_path_factory: pytest.TempPathFactory, collector: tuple[Collector, str],
              upstream: Upstream) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("tracing-openai")
    config = write_config(tmp, {"model": "llava-1.5-7b", "served_model_name": "mock", "backends": [
        {"id": "up0", "kind": "openai", "role": "language", "gpu": "H100", "address": upstream.url}]})
    with run_gateway(config, healthy=0, env=tracing_env(collector[1])) as gw:
        gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=2).status_code == 200)
        yield gw


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def test_a_streamed_request_is_one_trace_under_the_clients_span_and_the_upstream_joins_it(
    openai_gw: Gateway, collector: tuple[Collector, str], upstream: Upstream,
) -> None:
    received, _ = collector
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "stream": True}
    with httpx.stream("POST", f"{openai_gw.url}{CHAT}", json=body, timeout=30,
                      headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as r:
        assert r.status_code == 200
        r.read()

    spans = received.wait(lambda: (s := received.trace(TRACE_ID)) and {x.name for x in s} >= {
        "chat mock", "route", "attempt up0", "first_token", "stream"} and s)
    root, route, attempt = one(spans, "chat mock"), one(spans, "route"), one(spans, "attempt up0")
    assert (root.parent_id, root.kind, root.service) == (CLIENT_SPAN, "server", "heterogate-gateway")
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == "mock"
    assert root.attributes["gen_ai.usage.input_tokens"] == 5
    assert root.attributes["gen_ai.usage.output_tokens"] == TOKENS
    assert root.attributes["http.response.status_code"] == 200
    assert route.parent_id == root.span_id
    assert route.attributes["heterogate.backend"] == "up0"
    assert route.attributes["heterogate.policy"]
    assert {"heterogate.cost.total", "heterogate.cost.prefill", "heterogate.cost.queue"} <= route.attributes.keys()
    assert (attempt.parent_id, attempt.kind) == (root.span_id, "client")
    for name in ("first_token", "stream"):
        assert one(spans, name).parent_id == attempt.span_id
    assert one(spans, "stream").attributes["gen_ai.usage.output_tokens"] == TOKENS
    # the upstream was handed the attempt's span as its parent, in the client's trace
    assert f"00-{TRACE_ID}-{attempt.span_id}-01" in upstream.traceparents
    # and the request's mean inter-token time is in /metrics
    assert metric_total(openai_gw, "heterogate_itl_seconds_count", backend="up0") >= 1


def test_a_request_without_traceparent_starts_its_own_trace(
    openai_gw: Gateway, collector: tuple[Collector, str], upstream: Upstream,
) -> None:
    received, _ = collector
    before = len(upstream.traceparents)
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{openai_gw.url}{CHAT}", json=body, headers={"x-request-id": "untraced-client-1"}, timeout=30)
    assert r.status_code == 200, r.text
    root = received.wait(lambda: next((s for s in received.spans if s.name == "chat mock"
                                       and s.attributes.get("heterogate.request_id") == "untraced-client-1"), None))
    assert root.parent_id == ""
    sent = upstream.traceparents[before]
    assert sent is not None and sent.startswith(f"00-{root.trace_id}-")


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
])
def test_a_request_refused_before_the_pipeline_is_a_span_in_the_clients_trace(
    openai_gw: Gateway, collector: tuple[Collector, str], body: dict[str, Any], status: int,
) -> None:
    """A client following its 400 or 404 finds it in its trace: the request's span with the status (a
    client error, not a failed span), where it had none."""
    received, _ = collector
    trace_id = f"{status:032x}"
    r = httpx.post(f"{openai_gw.url}{CHAT}", json=body, timeout=30,
                   headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01", "x-request-id": f"refused-{status}"})
    assert r.status_code == status, r.text
    root = received.wait(lambda: next(iter(received.trace(trace_id)), None))
    assert (root.name, root.parent_id, root.kind) == ("chat", CLIENT_SPAN, "server")
    assert root.attributes["http.response.status_code"] == status
    assert root.attributes["error.type"] == str(status) and not root.failed
    assert root.attributes["heterogate.request_id"] == f"refused-{status}"


def unsampled(trace_id: str) -> re.Pattern[str]:
    """A traceparent in trace `trace_id` with the sampled flag off, under a span of the gateway's own."""
    return re.compile(rf"00-{trace_id}-(?!{CLIENT_SPAN})(?!0{{16}})[0-9a-f]{{16}}-00")


def test_an_unsampled_client_trace_is_passed_on_to_the_upstream_with_the_flag_off(
    openai_gw: Gateway, upstream: Upstream,
) -> None:
    """W3C Trace Context: the gateway's sampler (parent-based) leaves the request out, and the upstream
    still gets a traceparent in the client's trace, so that its logs name the trace the client started."""
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    before = len(upstream.traceparents)
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{openai_gw.url}{CHAT}", json=body, timeout=30,
                   headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-00"})
    assert r.status_code == 200, r.text
    sent = upstream.traceparents[before]
    assert sent is not None and unsampled(trace_id).fullmatch(sent), sent


def test_the_clients_tracestate_is_passed_on(openai_gw: Gateway, upstream: Upstream) -> None:
    before = len(upstream.tracestates)
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{openai_gw.url}{CHAT}", json=body, timeout=30, headers={
        "traceparent": f"00-7bf92f3577b34da6a3ce929d0e0e4736-{CLIENT_SPAN}-01", "tracestate": "congo=t61rcWkgMzE"})
    assert r.status_code == 200, r.text
    assert upstream.tracestates[before] == "congo=t61rcWkgMzE"


def test_with_tracing_off_the_clients_trace_context_is_passed_on_as_sent(tmp_path: Path, upstream: Upstream) -> None:
    """A gateway that traces nothing is a hop like any proxy: the upstream's spans (vLLM with
    --otlp-traces-endpoint) join the client's trace; they were cut off from it. A header that is no W3C
    traceparent is not passed on."""
    config = write_config(tmp_path, {"model": "llava-1.5-7b", "served_model_name": "mock", "backends": [
        {"id": "up0", "kind": "openai", "role": "language", "gpu": "H100", "address": upstream.url}]})
    with run_gateway(config, healthy=0) as gw:   # no OTEL_* variables: tracing off
        gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=2).status_code == 200)
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        client = f"00-8bf92f3577b34da6a3ce929d0e0e4735-{CLIENT_SPAN}-01"
        sent: list[tuple[str | None, str | None]] = []
        for headers in ({"traceparent": client, "tracestate": "congo=t61rcWkgMzE"}, {"traceparent": "nonsense"}, {}):
            before = len(upstream.traceparents)
            assert httpx.post(f"{gw.url}{CHAT}", json=body, headers=headers, timeout=30).status_code == 200
            sent.append((upstream.traceparents[before], upstream.tracestates[before]))
    assert sent == [(client, "congo=t61rcWkgMzE"), (None, None), (None, None)]


def test_a_request_the_ratio_sampler_leaves_out_passes_a_new_trace_on(
    tmp_path: Path, collector: tuple[Collector, str], upstream: Upstream,
) -> None:
    config = write_config(tmp_path, {"model": "llava-1.5-7b", "served_model_name": "mock", "backends": [
        {"id": "up0", "kind": "openai", "role": "language", "gpu": "H100", "address": upstream.url}]})
    env = {**tracing_env(collector[1]), "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.0"}
    with run_gateway(config, healthy=0, env=env) as gw:
        gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=2).status_code == 200)
        before = len(upstream.traceparents)
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{gw.url}{CHAT}", json=body, timeout=30).status_code == 200
        sent = upstream.traceparents[before]
    assert sent is not None and unsampled("(?!0{32})[0-9a-f]{32}").fullmatch(sent), sent


def test_an_image_request_traces_encode_hand_off_and_both_engines(
    tmp_path: Path, collector: tuple[Collector, str],
) -> None:
    """Managed simulated engines inherit the gateway's OTEL_* variables: their spans join the trace under
    the gateway's attempt (the language engine) and encode (the vision engine) spans."""
    received, endpoint = collector
    launch = {"time_scale": 0.05}
    gateway = {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20}
    config = write_config(tmp_path, {"model": "llava-1.5-7b", "gateway": gateway, "backends": [
        {"id": "lang-0", "role": "language", "gpu": "H100", "launch": launch},
        {"id": "vis-0", "role": "vision", "gpu": "RTX-4090", "launch": launch}]})
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with run_gateway(config, env=tracing_env(endpoint)) as gw:
        messages = [{"role": "user", "content": [text_part("What is this?"),
                                                 image_part(data_url(image_bytes("PNG", (32, 32))))]}]
        r = httpx.post(f"{gw.url}{CHAT}", json={"model": "llava-1.5-7b", "messages": messages, "max_tokens": 3},
                       headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}, timeout=30)
        assert r.status_code == 200, r.text
        spans = received.wait(lambda: (s := received.trace(trace_id)) and {x.name for x in s} >= {
            "chat llava-1.5-7b", "attempt lang-0", "encode vis-0", "engine generate", "engine encode",
            "first_token", "stream"} and s)
    root, attempt, encode = one(spans, "chat llava-1.5-7b"), one(spans, "attempt lang-0"), one(spans, "encode vis-0")
    assert root.attributes["heterogate.images"] == 1
    assert encode.parent_id == attempt.span_id
    assert encode.attributes["heterogate.handoff"] == "direct"
    assert encode.attributes["heterogate.embedding_bytes"] > 0
    assert "heterogate.handoff_wait_s" in one(spans, "first_token").attributes
    engine, vision = one(spans, "engine generate"), one(spans, "engine encode")
    assert (engine.service, engine.parent_id, engine.kind) == ("heterogate-engine", attempt.span_id, "server")
    assert engine.attributes["heterogate.backend"] == "lang-0"
    assert engine.attributes["gen_ai.usage.output_tokens"] == 3
    assert "first_token" in engine.events
    assert (vision.parent_id, vision.attributes["heterogate.backend"]) == (encode.span_id, "vis-0")


def test_the_grpc_door_honours_traceparent_metadata(openai_gw: Gateway, collector: tuple[Collector, str]) -> None:
    received, _ = collector
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"

    async def generate() -> list[inference_pb2.GenerateReply]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{openai_gw.grpc_port}") as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(model="mock", prompt="Once", max_tokens=2),
                metadata=(("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),), timeout=30)
            return [reply async for reply in call]

    assert asyncio.run(generate())[-1].finish_reason
    names = {"attempt up0", "text_completion mock"}   # the root is exported last, at the request's log line
    spans = received.wait(lambda: (s := received.trace(trace_id)) and names <= {x.name for x in s} and s)
    root = one(spans, "text_completion mock")
    assert (root.parent_id, root.attributes["gen_ai.operation.name"]) == (CLIENT_SPAN, "text_completion")
