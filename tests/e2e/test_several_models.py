"""One gateway, several models (gateway/config/models.py), from a real gateway process on 127.0.0.1:
simulated engines of each model, and an OpenAI-compatible upstream (tests/fake_openai_server.py) serving
three. A request goes to its model's pool only; an alias reaches the model under its own name (upstream
included); /v1/models lists them; each model's context is its own on the upstream that serves several;
readiness and /metrics are per model: a model left without a backend answers 503 and is named degraded
while the other model is served; a vision model served by language engines alone refuses images (400)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from testkit import harness
from testkit.harness import Gateway, free_port, metric_total, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

pytestmark = pytest.mark.timeout(240)
LLAVA, LLAMA, QWEN, QWEN_TEXT = "llava-1.5-7b", "llama", "qwen", "qwen-text"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    tmp = tmp_path_factory.mktemp("models")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    fast = {"time_scale": 0.05}
    config = write_config(tmp, {
        "model": LLAVA, "aliases": ["llava"],
        "models": [{"name": LLAMA, "catalog": "llama-2-7b", "aliases": ["llama-chat"]},
                   {"name": QWEN, "catalog": "qwen2.5-vl-7b"},        # 32k context, on the upstream only
                   {"name": QWEN_TEXT, "catalog": "qwen2.5-vl-7b"}],  # takes images; no backend encodes them
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [
            {"id": "llava-0", "gpu": "H100", "launch": fast},
            {"id": "llava-1", "gpu": "A100-80GB", "launch": fast},
            {"id": "llama-0", "gpu": "L40S", "model": LLAMA, "launch": fast},
            {"id": "qwen-text-0", "role": "language", "gpu": "L40S", "model": QWEN_TEXT, "launch": fast},
            {"id": "up", "kind": "openai", "gpu": "L40S", "address": url, "model": [LLAVA, LLAMA, QWEN]},
        ],
    })
    try:
        with run_gateway(config, healthy=4, timeout=90) as gw:
            yield gw, url
    finally:
        stop(upstream)


def chat(gw: Gateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-timeout": "10"}, timeout=30)


def test_models_are_listed_with_their_aliases(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    cards = httpx.get(f"{gw.url}/v1/models", timeout=5).json()["data"]
    assert [(c["id"], c["aliases"]) for c in cards] == [
        (LLAVA, ["llava"]), (LLAMA, ["llama-chat"]), (QWEN, []), (QWEN_TEXT, [])]
    assert [c["max_model_len"] for c in cards] == [4096, 4096, 32768, 32768]
    assert httpx.get(f"{gw.url}/v1/models/llama-chat", timeout=5).json()["id"] == LLAMA
    missing = httpx.get(f"{gw.url}/v1/models/gpt-4", timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    up = {b["id"]: b for b in gw.backends()}["up"]
    assert up["models"] == [LLAMA, LLAVA, QWEN]
    assert up["model_contexts"] == {LLAMA: [4096, "catalog"], LLAVA: [4096, "catalog"], QWEN: [32768, "catalog"]}


def test_each_model_has_its_own_context_on_an_upstream_serving_several(gateway: tuple[Gateway, str]) -> None:
    """The upstream's first model has a 4k context, its third 32k: a 6k-token prompt goes there for the third
    and is refused for the first (it was refused for both, the upstream's contexts all read as its first's)."""
    gw, _ = gateway
    long = "word " * 6000
    for model, status in ((QWEN, 200), (LLAVA, 400)):
        body = {"model": model, "messages": [{"role": "user", "content": long}], "max_tokens": 3}
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == status, resp.text
        if status == 200:
            assert resp.headers["x-heterogate-backend"] == "up"
        else:
            assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_a_vision_model_no_backend_encodes_for_takes_text_only(gateway: tuple[Gateway, str]) -> None:
    """Its image requests were held for an encoder of another model and answered 503 with Retry-After, for ever."""
    gw, _ = gateway
    image = [harness.text_part("what is this?"), harness.image_part(harness.data_url(harness.image_bytes()))]
    body = {"model": QWEN_TEXT, "messages": [{"role": "user", "content": image}], "max_tokens": 3}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages" and f"model '{QWEN_TEXT}' takes images, but no backend" in error["message"]
    assert chat(gw, QWEN_TEXT).status_code == 200


def test_each_request_goes_to_its_models_pool(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    for model, pool in ((LLAVA, {"llava-0", "llava-1"}), ("llava", {"llava-0", "llava-1"}),
                        (LLAMA, {"llama-0"}), ("llama-chat", {"llama-0"})):
        for _ in range(4):
            resp = chat(gw, model)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-heterogate-backend"] in pool   # the upstream, unscraped, looks saturated
            assert resp.json()["model"] == (LLAMA if "llama" in model else LLAVA)
    unknown = chat(gw, "gpt-4")
    assert unknown.status_code == 404
    assert "serves 'llava-1.5-7b', 'llama'" in unknown.json()["error"]["message"]
    assert metric_total(gw, "heterogate_requests_total", model=LLAMA, status="200") >= 8
    assert metric_total(gw, "heterogate_backend_model", backend="up", model=LLAMA) == 1
    # the unscraped upstream is never heard from, yet it serves: what deploy/'s BackendDown alert reads
    assert metric_total(gw, "heterogate_backend_healthy", backend="up") == 0
    assert metric_total(gw, "heterogate_backend_serving", backend="up") == 1


def test_an_alias_reaches_the_upstream_under_the_models_name(gateway: tuple[Gateway, str]) -> None:
    gw, url = gateway
    drain = httpx.post(f"{gw.url}/admin/backends/llama-0/drain", timeout=10)
    assert drain.status_code == 202, drain.text
    resp = chat(gw, "llama-chat")   # only the upstream serves the model now (failing open on it)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-heterogate-backend"] == "up"
    assert resp.json()["model"] == LLAMA
    assert httpx.get(f"{url}/stats", timeout=5).json()["last_body"]["model"] == LLAMA


def test_readiness_and_metrics_are_per_model(gateway: tuple[Gateway, str]) -> None:
    gw, _ = gateway
    httpx.post(f"{gw.url}/admin/backends/llama-0/drain", timeout=10)
    httpx.post(f"{gw.url}/admin/backends/up/drain", timeout=10).raise_for_status()
    ready = httpx.get(f"{gw.url}/ready", timeout=5)
    assert ready.status_code == 200   # the other model is served: the replica stays in its balancer
    state = ready.json()
    assert state["models"][LLAMA] == {"ready": False, "healthy_language_backends": 0}
    assert state["models"][LLAVA]["ready"] is True
    assert state["degraded"] == [f"model:{LLAMA}", f"model:{QWEN}"]
    assert metric_total(gw, "heterogate_model_servable_backends", model=LLAMA) == 0
    assert metric_total(gw, "heterogate_model_servable_backends", model=LLAVA) == 2
    refused = chat(gw, LLAMA)
    assert refused.status_code == 503, refused.text
    assert f"of model '{LLAMA}'" in refused.json()["error"]["message"]
    assert chat(gw, LLAVA).status_code == 200
    # a drained backend may go while a drained one of its model stays; the model's last one may not
    removed = httpx.delete(f"{gw.url}/admin/backends/llama-0", timeout=10)
    assert removed.status_code == 202, removed.text
    gw.wait_until(lambda: "llama-0" not in [b["id"] for b in gw.backends()], timeout=30)
    last = httpx.delete(f"{gw.url}/admin/backends/up", timeout=10)
    assert last.status_code == 409 and LLAMA in last.json()["error"]["message"], last.text
