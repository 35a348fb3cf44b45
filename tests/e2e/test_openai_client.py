"""The official openai client against the default demo cluster, unchanged."""

from __future__ import annotations

import httpx
import openai

from testkit.harness import Gateway

MODEL = "llava-1.5-7b"


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_chat_completion_plain(demo_gateway: Gateway) -> None:
    resp = client(demo_gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a heterogeneous GPU cluster."}], max_tokens=12
    )
    completion = resp.parse()
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in {"stop", "length"}
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 12
    assert resp.headers["x-request-id"]
    ids = {b["id"] for b in demo_gateway.backends()}
    assert resp.headers["x-heterogate-backend"] in ids


def test_chat_completion_streaming(demo_gateway: Gateway) -> None:
    stream = client(demo_gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream please"}], max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text and finish in {"stop", "length"}
    assert usage is not None and usage.completion_tokens == len(text.split())


def test_completions_endpoint(demo_gateway: Gateway) -> None:
    out = client(demo_gateway).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert out.choices[0].text and out.usage is not None and out.usage.completion_tokens == 5


def test_models_and_health(demo_gateway: Gateway) -> None:
    models = client(demo_gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{demo_gateway.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{demo_gateway.url}/ready")
    assert ready.status_code == 200 and ready.json()["healthy_language_backends"] == 8


def test_admin_backends_shape(demo_gateway: Gateway) -> None:
    backends = demo_gateway.backends()
    language = [b for b in backends if b["role"] == "language"]
    assert len(language) == 8
    assert {b["gpu"] for b in language} == {"H100", "A100-80GB", "L40S"}
    assert {b["gpu"] for b in backends if b["role"] == "vision"} == {"RTX-4090"}
    for b in backends:
        for key in ("id", "role", "gpu", "healthy", "queue_depth", "in_flight", "kv_free_bytes", "kv_total_bytes"):
            assert key in b
        assert b["healthy"] and b["kv_total_bytes"] > 0
