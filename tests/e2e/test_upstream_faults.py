"""A kind: openai upstream that refuses, rate-limits, does not serve the model, or speaks TLS behind a private CA.

The gateway runs as its own process in front of a loopback aiohttp server that answers as vLLM and
SGLang do in each case: their error bodies (SGLang's and older vLLM's `{"object": "error", "message"}`,
current vLLM's `{"error": {...}}`), a 429 with Retry-After, a 404 for a model it does not serve.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from aiohttp import web

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, free_port, run_gateway, write_config
from tests.tls_certs import self_signed

MODEL = "llava-1.5-7b"
SERVED = "served-model"


class Engine:
    """A vLLM-like engine on 127.0.0.1: serves SERVED; `refusal` (status, body, headers) answers every
    completion while set; `requests` counts the completions asked of it."""

    def __init__(self) -> None:
        self.refusal: tuple[int, dict[str, Any], dict[str, str]] | None = None
        self.stream_error: tuple[int, dict[str, Any]] | None = None   # (words before it, the error event)
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat)])
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.refusal is not None:
            status, error, headers = self.refusal
            return web.json_response(error, status=status, headers=headers)
        if body["model"] != SERVED:   # vLLM's answer for a model it does not serve
            return web.json_response({"object": "error", "message": f"The model `{body['model']}` does not exist.",
                                      "type": "NotFoundError", "param": None, "code": 404}, status=404)
        text = "hello there"
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if self.stream_error is not None:   # as vLLM and SGLang report an error found once streaming: after the 200
            words, error = self.stream_error
            events = [{"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0, "model": SERVED,
                       "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                      for w in text.split()[:words]]
            await resp.write(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in [*events, error])
                             + b"data: [DONE]\n\n")   # one write: one read at the gateway
            return resp
        for i, word in enumerate(text.split()):
            choice = {"index": 0, "delta": {"content": word}, "finish_reason": "stop" if i else None}
            event = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0, "model": SERVED,
                     "choices": [choice]}
            await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@contextmanager
def serving(engine: Engine, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """`engine` on a loopback port, on a thread of its own, until the block ends; its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(engine.app())
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def config(tmp: Path, address: str, upstream_model: str = SERVED, breaker: bool = False) -> Path:
    return write_config(tmp, {
        "model": MODEL,
        # no breaker opens in these tests (unless `breaker`: the default one): each refusal is asked for,
        # and the next request must reach it
        "gateway": {"heartbeat_interval_ms": 100, "breaker": {} if breaker else {"failure_threshold": 1000}},
        "backends": [{"id": "up", "kind": "openai", "gpu": "H100", "address": address,
                      "upstream_model": upstream_model}],
    })


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def gateway(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serving(engine) as url, run_gateway(config(tmp_path_factory.mktemp("faults"), url), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        yield gw


@pytest.fixture
def refusing(engine: Engine) -> Iterator[Engine]:
    engine.requests = 0
    yield engine
    engine.refusal = None


def chat(gw: Gateway, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)


# The same refusal as each engine writes it.
TOO_LONG = "This model's maximum context length is 4096 tokens."
ERROR_BODIES = {
    "sglang": {"object": "error", "message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400},
    "vllm": {"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400}},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine_name", sorted(ERROR_BODIES))
def test_an_engines_refusal_reaches_the_client_as_its_message(
    gateway: Gateway, refusing: Engine, engine_name: str, stream: bool,
) -> None:
    refusing.refusal = (400, ERROR_BODIES[engine_name], {})
    resp = chat(gateway, stream)
    assert resp.status_code == 400
    assert resp.json()["error"] == {"message": f"upstream rejected the request: {TOO_LONG}",
                                    "type": "invalid_request_error", "param": None, "code": None}


def test_a_fastapi_servers_validation_error_reaches_the_client_as_its_messages(gateway: Gateway,
                                                                            refusing: Engine) -> None:
    """A FastAPI server's 422 `{"detail": [...]}` reached the client as the raw JSON of its body."""
    refusing.refusal = (422, {"detail": [{"loc": ["body", "messages", 0, "content"], "msg": "Field required",
                                          "type": "missing"}]}, {})
    resp = chat(gateway, False)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "upstream rejected the request: body.messages.0.content: Field required"


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_429_reaches_the_client_as_a_429_with_its_retry_after(
    gateway: Gateway, refusing: Engine, stream: bool,
) -> None:
    refusing.refusal = (429, {"object": "error", "message": "too many requests", "type": "RateLimitError",
                              "param": None, "code": 429}, {"Retry-After": "7"})
    resp = chat(gateway, stream)
    assert (resp.status_code, resp.headers.get("retry-after")) == (429, "7")
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert refusing.requests == 1   # one backend: asked once
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_a_model_the_upstream_does_not_serve_is_the_backends_failure(engine: Engine, tmp_path: Path) -> None:
    """A wrong `upstream_model` is the gateway's configuration, not the client's request: no 400."""
    with serving(engine) as url, run_gateway(config(tmp_path, url, upstream_model="not-served"), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        for stream in (False, True):
            resp = chat(gw, stream)
            assert resp.status_code == 502, resp.text
            assert resp.json()["error"]["code"] == "backend_failure"
        assert "does not exist" in gw.log_path.read_text()   # the operator's log says why


def test_a_tls_upstream_behind_a_private_ca_is_probed_as_its_requests_are_sent(tmp_path: Path) -> None:
    """The CA is trusted through SSL_CERT_FILE: the probe must trust it as the request path does."""
    cert, key = self_signed(tmp_path, "engine")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    with serving(Engine(), tls) as url, run_gateway(config(tmp_path, url), healthy=0,
                                                    env={"SSL_CERT_FILE": str(cert)}) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        for stream in (False, True):
            resp = chat(gw, stream)
            assert resp.status_code == 200, resp.text
        assert "hello" in resp.text


# An upstream's 429 as the request's last answer: the client is told the upstream is rate limiting, on both
# doors (named backend, the upstream's own message, Retry-After or the gRPC `retry-after` trailer).
SAID = "too many requests, slow down"


@pytest.fixture
def limiting(engine: Engine) -> Iterator[Engine]:
    """The upstream answers every completion 429, with `SAID` as vLLM writes its errors, until the test ends."""
    engine.refusal = (429, {"error": {"message": SAID, "type": "RateLimitError", "param": None, "code": 429}},
                      {"Retry-After": "7"})
    yield engine
    engine.refusal = None


@pytest.mark.parametrize("stream", [False, True])
def test_the_http_door_says_the_upstream_is_rate_limiting(gateway: Gateway, limiting: Engine, stream: bool) -> None:
    resp = chat(gateway, stream)
    assert (resp.status_code, resp.headers.get("retry-after")) == (429, "7")
    assert resp.json()["error"] == {"message": f"backend up is rate limiting requests: {SAID}",
                                    "type": "rate_limit_error", "param": None, "code": "upstream_rate_limited"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_503_with_retry_after_reaches_the_client_as_such(gateway: Gateway, refusing: Engine,
                                                                     stream: bool) -> None:
    """Overloaded and saying when to come back (an engine shedding load, a balancer in front of engines):
    the client gets the 503 and its Retry-After, not a 502 without one. Without a Retry-After it is the
    backend's failure, a 502, as before."""
    refusing.refusal = (503, {"error": {"message": "server overloaded", "code": 503}}, {"Retry-After": "9"})
    resp = chat(gateway, stream)
    assert (resp.status_code, resp.headers.get("retry-after")) == (503, "9"), resp.text
    assert resp.json()["error"] == {"message": "backend up is unavailable for now: server overloaded",
                                    "type": "service_unavailable", "param": None, "code": "upstream_unavailable"}
    refusing.refusal = (503, {"error": {"message": "no healthy upstream"}}, {})
    resp = chat(gateway, stream)
    assert (resp.status_code, resp.json()["error"]["code"]) == (502, "backend_failure")


def test_an_upstream_408_is_the_backends_failure_not_the_clients(gateway: Gateway, refusing: Engine) -> None:
    """The upstream timed out reading the gateway's request (whole at the gateway by then): retried
    elsewhere where there is another backend, a 502 here. It was the client's 400, never retried."""
    refusing.refusal = (408, {"error": {"message": "request timeout"}}, {})
    resp = chat(gateway, False)
    assert (resp.status_code, resp.json()["error"]["code"]) == (502, "backend_failure"), resp.text


def test_an_upstream_429_without_a_message_still_names_the_backend(gateway: Gateway, engine: Engine) -> None:
    engine.refusal = (429, {}, {"Retry-After": "3"})
    try:
        resp = chat(gateway, False)
    finally:
        engine.refusal = None
    assert resp.status_code == 429
    assert resp.json()["error"]["message"].startswith("backend up is rate limiting requests")
    assert "failed or could not be reached" not in resp.text


async def test_the_grpc_door_is_resource_exhausted_with_the_message_and_retry_after(
    gateway: Gateway, limiting: Engine,
) -> None:
    request = inference_pb2.GenerateRequest(model=MODEL, messages=[inference_pb2.Message(role="user", text="hi")],
                                            max_tokens=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=30)]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == f"backend up is rate limiting requests: {SAID}"
    assert dict(info.value.trailing_metadata() or ())["retry-after"] == "7"


@pytest.mark.parametrize("status", [429, 503])
def test_an_upstream_that_rate_limits_is_busy_not_broken(tmp_path: Path, status: int) -> None:
    """429s, and 503s that say when to come back, do not open the upstream's circuit breaker (5
    consecutive failures would by default): once it stops refusing, the next request is served, not
    refused with 503 for the breaker's open time. A 503 with its Retry-After was a 502 that counted."""
    engine = Engine()
    engine.refusal = (status, {}, {"Retry-After": "1"})
    with serving(engine) as url, run_gateway(config(tmp_path, url, breaker=True), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        assert [chat(gw, False).status_code for _ in range(8)] == [status] * 8
        assert gw.backend("up")["breaker"] == "closed"
        engine.refusal = None
        resp = chat(gw, False)
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("engine_name", sorted(ERROR_BODIES))
def test_an_error_event_in_a_stream_is_the_clients_400_not_the_backends_fault(engine_name: str, tmp_path: Path) -> None:
    """vLLM and SGLang answer some refusals with a 200 whose stream holds only an error event, its HTTP
    status as `code`. It was a backend failure: retried, a 502 naming the backend (SGLang's shape: "stream
    ended without a finish reason"), a fault for the breaker: five such requests opened it and the next
    request got 503."""
    engine = Engine()
    engine.stream_error = (0, ERROR_BODIES[engine_name])
    with serving(engine) as url, run_gateway(config(tmp_path, url, breaker=True), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        for _ in range(6):
            resp = chat(gw, True)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["message"] == f"upstream rejected the request: {TOO_LONG}"
        assert engine.requests == 6   # none retried
        assert gw.backend("up")["breaker"] == "closed"
        engine.stream_error = None
        assert chat(gw, True).status_code == 200


def test_tokens_read_with_a_mid_stream_error_event_reach_the_client_before_it(tmp_path: Path) -> None:
    """Two words and an engine's error event in one read: the words were dropped, the error came alone."""
    engine = Engine()
    engine.stream_error = (2, {"error": {"message": "CUDA out of memory", "type": "InternalServerError",
                                         "param": None, "code": 500}})
    with serving(engine) as url, run_gateway(config(tmp_path, url), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        resp = chat(gw, True)
    assert resp.status_code == 200   # the stream had begun
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    words = [e["choices"][0]["delta"].get("content") for e in events if e.get("choices")]
    assert "".join(w or "" for w in words) == "hellothere", resp.text
    assert events[-1]["error"]["type"] == "backend_error", resp.text
