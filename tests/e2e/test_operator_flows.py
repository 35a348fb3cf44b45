"""What an operator running the gateway for several teams meets, on a real gateway with simulated engines:
OpenAI's own client against tenants' refusals (a 429 no retry could pass is not retried by the client), the
gRPC door's refusals carrying the wait the HTTP door's Retry-After names, the log line of a tenant's request
refused before admission naming the tenant, and a backend drained on purpose kept out of the deploy/ alert
on backends that are down."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import ROOT, Gateway, run_gateway, write_config
from tests.e2e.test_tenants import minute_room

pytestmark = pytest.mark.timeout(180)
MODEL = "llava-1.5-7b"
ADMIN, LARGE, DAILY, RPM = "sk-ops-admin", "sk-ops-large", "sk-ops-daily", "sk-ops-rpm"
DAY_TOKENS = 40   # one request of max_tokens 30 (prompt ~5) fits; a second one by itself too, not after the first


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("operator")
    for name, key in (("admin", ADMIN), ("large", LARGE), ("daily", DAILY), ("rpm", RPM)):
        (tmp / f"{name}.keys").write_text(f"{key}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
            "auth": {"admin_keys_file": str(tmp / "admin.keys"), "cluster_token_file": str(tmp / "cluster.token")},
            "tenants": {"teams": {
                "large": {"api_keys_file": str(tmp / "large.keys"), "tokens_per_minute": 100},
                "daily": {"api_keys_file": str(tmp / "daily.keys"), "tokens_per_day": DAY_TOKENS},
                "rpm": {"api_keys_file": str(tmp / "rpm.keys"), "requests_per_minute": 1}}},
        },
        "backends": [{"id": b, "role": "language", "gpu": gpu, "launch": {"time_scale": 0.1}}
                     for b, gpu in (("h100-0", "H100"), ("l40s-0", "L40S"), ("l40s-1", "L40S"))],
    })
    with run_gateway(config, "--log-level", "info", admin_key=ADMIN) as gw:   # info: the request log lines
        yield gw


def samples(gw: Gateway, name: str) -> dict[frozenset[tuple[str, str]], float]:
    text = httpx.get(f"{gw.url}/metrics", headers=gw.admin_headers, timeout=10).text
    return {frozenset(s.labels.items()): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def refusals(gw: Gateway, tenant: str) -> float:
    return sum(v for labels, v in samples(gw, "heterogate_tenant_rate_limited_total").items()
               if ("tenant", tenant) in labels)


def ask(gw: Gateway, key: str, max_tokens: int) -> openai.types.chat.ChatCompletion:
    """One chat through OpenAI's client as a team would use it: its default two retries on."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=2, timeout=30)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=max_tokens)


def day_room(seconds: float = 120.0) -> None:
    """The daily window ends at UTC midnight: start far enough from it that its Retry-After is hours."""
    into = time.time() % 86_400
    if into > 86_400 - seconds:
        time.sleep(86_400 - into + 0.1)


def test_openai_client_does_not_retry_a_429_that_no_retry_could_pass(gateway: Gateway) -> None:
    """Over its limit by itself (no Retry-After) and a spent daily budget (Retry-After of hours): the client
    sends each once, not three times, and the tenant's refusals count one each."""
    with pytest.raises(openai.RateLimitError) as too_large:
        ask(gateway, LARGE, 200)
    assert too_large.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in too_large.value.response.headers
    assert refusals(gateway, "large") == 1

    day_room()
    ask(gateway, DAILY, 30)
    with pytest.raises(openai.RateLimitError) as spent:
        ask(gateway, DAILY, 30)
    assert spent.value.response.headers["x-should-retry"] == "false"
    assert int(spent.value.response.headers["retry-after"]) > 60
    assert refusals(gateway, "daily") == 1


async def test_a_refusal_with_a_wait_names_it_on_both_doors(gateway: Gateway) -> None:
    """A requests-per-minute refusal: HTTP's Retry-After (retried by the client after it, so no
    x-should-retry), and the gRPC door's `retry-after` trailer."""
    minute_room()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {RPM}"}
    with gateway.client() as client:
        assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        refused = client.post("/v1/chat/completions", json=body, headers=auth)
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert "x-should-retry" not in refused.headers
    request = inference_pb2.GenerateRequest(model=MODEL, messages=[inference_pb2.Message(role="user", text="hi")],
                                            max_tokens=2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.Generate(request, metadata=tuple(auth.items()), timeout=30)]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(info.value.trailing_metadata() or ())
    assert 1 <= int(trailers["retry-after"]) <= 60


def log_line(gw: Gateway, request_id: str) -> dict[str, Any]:
    """The request's log line (written once its reply is sent)."""
    def find() -> dict[str, Any] | None:
        for line in gw.log_path.read_text(errors="replace").splitlines():
            if request_id in line and line.startswith("{"):
                entry: dict[str, Any] = json.loads(line)
                if entry.get("event") == "request" and entry.get("request_id") == request_id:
                    return entry
        return None

    found: dict[str, Any] = gw.wait_until(find, timeout=10)
    return found


async def test_a_request_refused_before_admission_is_logged_under_its_tenant(gateway: Gateway) -> None:
    """A 400 (max_tokens over the gateway's limit) on the HTTP door and one on the gRPC door (a prompt and
    messages both): their log lines name the tenant whose key sent them, as every request's does."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}
    with gateway.client() as client:
        refused = client.post("/v1/chat/completions", json=body,
                              headers={"authorization": f"Bearer {LARGE}", "x-request-id": "ops-http-400"})
    assert refused.status_code == 400
    assert log_line(gateway, "ops-http-400")["tenant"] == "large"
    request = inference_pb2.GenerateRequest(model=MODEL, prompt="hi", request_id="ops-grpc-400",
                                            messages=[inference_pb2.Message(role="user", text="hi")])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.Generate(request, metadata=(("authorization", f"Bearer {LARGE}"),), timeout=30)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert log_line(gateway, "ops-grpc-400")["tenant"] == "large"


def test_a_drained_backend_is_not_alerted_on_as_down(gateway: Gateway) -> None:
    """Drained through the fleet API, a managed engine stops and `heterogate_backend_serving` goes to 0 on
    purpose; HeteroGateBackendDown (deploy/prometheus/alerts.yaml) leaves it out by its draining gauge."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    down = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "HeteroGateBackendDown")
    assert down["expr"].split() == "heterogate_backend_serving == 0 unless heterogate_backend_draining == 1".split()

    drained = httpx.post(f"{gateway.url}/admin/backends/l40s-1/drain", headers=gateway.admin_headers, timeout=10)
    assert drained.status_code == 202
    gateway.wait_until(lambda: gateway.backend("l40s-1")["state"] == "stopped", timeout=60)
    healthy = samples(gateway, "heterogate_backend_serving")
    draining = samples(gateway, "heterogate_backend_draining")
    assert {dict(labels)["backend"]: v for labels, v in draining.items()} == {"h100-0": 0, "l40s-0": 0, "l40s-1": 1}
    # the rule as Prometheus evaluates it on one scrape: `unless` drops the series matched on every label
    firing = {labels for labels, v in healthy.items() if v == 0} - {labels for labels, v in draining.items() if v == 1}
    assert healthy[next(labels for labels in healthy if ("backend", "l40s-1") in labels)] == 0
    assert firing == set()
