"""An upstream's 429 as the request's last answer tells the client the upstream is rate limiting, on both
doors: named backend, the upstream's own message, Retry-After (HTTP) or the `retry-after` trailer (gRPC).
A real gateway process in front of a loopback aiohttp upstream."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, run_gateway
from tests.e2e.test_upstream_faults import MODEL, Engine, chat, config, serving

pytestmark = pytest.mark.timeout(120)

SAID = "too many requests, slow down"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def gateway(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serving(engine) as url, run_gateway(config(tmp_path_factory.mktemp("limited"), url), healthy=0) as gw:
        gw.wait_until(lambda: gw.backend("up")["reachable"])
        yield gw


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
