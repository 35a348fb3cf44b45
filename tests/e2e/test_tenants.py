"""Tenants end to end: a real gateway with simulated engines and the keys of two tenants. The one over its
requests per minute gets 429 with Retry-After and OpenAI's error shape at once, streamed or not, while
the other keeps getting 200; usage per tenant shows in /metrics and /admin/usage (admin key only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, run_gateway, write_config

pytestmark = pytest.mark.timeout(180)
MODEL = "llava-1.5-7b"
ALPHA, BETA, GAMMA, PLAIN, ADMIN = "sk-alpha", "sk-beta", "sk-gamma", "sk-plain", "sk-admin"
ALPHA_RPM = 3


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("tenants")
    for name, key in (("alpha", ALPHA), ("beta", BETA), ("gamma", GAMMA), ("plain", PLAIN), ("admin", ADMIN)):
        (tmp / f"{name}.keys").write_text(f"{key}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "auth": {"api_keys_file": str(tmp / "plain.keys"), "admin_keys_file": str(tmp / "admin.keys"),
                     "cluster_token_file": str(tmp / "cluster.token")},
            "tenants": {"teams": {
                "alpha": {"api_keys_file": str(tmp / "alpha.keys"), "requests_per_minute": ALPHA_RPM},
                "beta": {"api_keys_file": str(tmp / "beta.keys"), "weight": 3, "tokens_per_minute": 1_000_000},
                "gamma": {"api_keys_file": str(tmp / "gamma.keys"), "requests_per_minute": 1}}},
        },
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}},
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 0.1}},
        ],
    })
    with run_gateway(config, admin_key=ADMIN) as gw:
        yield gw


def chat(gw: Gateway, key: str, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "stream": stream}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)


def minute_room(seconds: float = 10.0) -> None:
    """The limit counts whole minutes (the gateway's wall clock, this host's): start early enough in one
    that the test's requests fall into a single window. A test's requests take well under a second; the
    room is kept small because waiting for the next minute costs up to that much."""
    into = time.time() % 60
    if into > 60 - seconds:
        time.sleep(60 - into + 0.1)


def test_one_tenant_over_its_requests_per_minute_gets_429_and_the_other_keeps_going(gateway: Gateway) -> None:
    minute_room()
    for _ in range(ALPHA_RPM):
        assert chat(gateway, ALPHA).status_code == 200
    for stream in (False, True):
        refused = chat(gateway, ALPHA, stream=stream)
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert f"tenant 'alpha' on requests per minute: limit {ALPHA_RPM}, used {ALPHA_RPM}" in error["message"]
    for key in (BETA, PLAIN, BETA):
        assert chat(gateway, key).status_code == 200
    streamed = chat(gateway, BETA, stream=True)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def usage(gw: Gateway) -> dict[str, dict[str, Any]]:
    resp = httpx.get(f"{gw.url}/admin/usage", headers=gw.admin_headers, timeout=10)
    assert resp.status_code == 200
    return {t["tenant"]: t for t in resp.json()["data"]}


def metrics(gw: Gateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{gw.url}/metrics", headers=gw.admin_headers, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_usage_per_tenant_in_admin_usage_and_metrics(gateway: Gateway) -> None:
    for key, status in ((None, 401), (BETA, 403)):   # the admin key only (a tenant's key is known, not allowed)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(f"{gateway.url}/admin/usage", headers=headers, timeout=10).status_code == status
    minute_room()
    before = usage(gateway)
    for _ in range(2):
        assert chat(gateway, BETA).status_code == 200
    for _ in range(ALPHA_RPM + 1):   # its window may be partly used already: until it is refused
        if chat(gateway, ALPHA).status_code == 429:
            break
    # refused before it is admitted (its body, its model): its tenant's all the same
    bad = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"authorization": f"Bearer {BETA}"}, timeout=10,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert bad.status_code == 400
    after = usage(gateway)
    assert set(after) == {"default", "alpha", "beta", "gamma"}
    beta, alpha = after["beta"], after["alpha"]
    assert (beta["priority"], beta["weight"], beta["limits"]) == (0, 3.0, {"tokens_per_minute": 1_000_000})
    assert beta["requests"] - before["beta"]["requests"] == 3
    assert beta["requests_by_status"]["400"] - before["beta"]["requests_by_status"].get("400", 0) == 1
    assert beta["prompt_tokens"] > before["beta"]["prompt_tokens"]
    assert beta["completion_tokens"] - before["beta"]["completion_tokens"] == 8   # max_tokens 4, twice
    window = beta["windows"]["tokens_per_minute"]
    assert window["limit"] == 1_000_000 and window["used"] > 0 and 0 < window["resets_in_s"] <= 60
    refused = before["alpha"]["rate_limited"].get("requests_per_minute", 0)
    assert alpha["rate_limited"]["requests_per_minute"] - refused == 1 and alpha["requests_by_status"]["429"] >= 1
    assert alpha["windows"]["requests_per_minute"]["used"] == ALPHA_RPM
    m = metrics(gateway)
    assert m["heterogate_tenant_requests_total", frozenset({("tenant", "beta"), ("status", "200")})] == \
        beta["requests_by_status"]["200"]
    assert m["heterogate_tenant_completion_tokens_total", frozenset({("tenant", "beta")})] == beta["completion_tokens"]
    assert m["heterogate_tenant_rate_limited_total",
             frozenset({("tenant", "alpha"), ("reason", "requests_per_minute")})] == alpha["rate_limited"][
        "requests_per_minute"]
    assert m["heterogate_tenant_admission_waiting", frozenset({("tenant", "default")})] == 0


async def test_the_grpc_door_names_the_tenant_too(gateway: Gateway) -> None:
    """gamma may send one request a minute: its second on the gRPC door is RESOURCE_EXHAUSTED."""
    minute_room()
    auth = (("authorization", f"Bearer {GAMMA}"),)
    request = inference_pb2.GenerateRequest(model=MODEL, messages=[inference_pb2.Message(role="user", text="hi")],
                                            max_tokens=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert [r async for r in stub.Generate(request, metadata=auth, timeout=30)][-1].finish_reason
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.Generate(request, metadata=auth, timeout=30)]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'gamma' on requests per minute: limit 1" in (info.value.details() or "")
