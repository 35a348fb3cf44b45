"""Faithful pass-through to kind: openai backends: a recording upstream receives every field the client
sent (changed only where the gateway must), with the backend's api key; tool calls and logprobs reach
the official openai client streamed and not; the gateway's own engines refuse what they cannot honour."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from testkit.harness import Gateway, free_port, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"
UPSTREAM_MODEL = "llava-hf/llava-1.5-7b-hf"
KEY = "upstream-secret"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Every kind of field a client may send: OpenAI's own, vLLM's and SGLang's extensions.
FIELDS: dict[str, Any] = {
    "tools": [WEATHER_TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    "logprobs": True, "top_logprobs": 2, "seed": 1234, "n": 1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
    "logit_bias": {"50256": -100}, "user": "user-7", "temperature": 0.3, "top_p": 0.9, "stop": ["\n\n"],
    "top_k": 20, "min_tokens": 2, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False},
    "guided_json": {"type": "object"}, "guided_choice": ["a", "b"], "metadata": {"trace": "x"},
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    tmp: Path = tmp_path_factory.mktemp("passthrough")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = spawn("tests.fake_openai_server", "--port", str(port), "--api-key", KEY)
    config = write_config(tmp, {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": "recorder", "kind": "openai", "gpu": "H100", "address": url,
                      "upstream_model": UPSTREAM_MODEL, "api_key_env": "HG_TEST_UPSTREAM_KEY",
                      "scrape": {"engine": "vllm", "interval_ms": 100}}],
    })
    mp = pytest.MonkeyPatch()
    mp.setenv("HG_TEST_UPSTREAM_KEY", KEY)
    try:
        with run_gateway(config, healthy=1, timeout=60) as gw:
            yield gw, url
    finally:
        mp.undo()
        stop(engine)


def recorded(url: str) -> tuple[dict[str, Any], str]:
    stats = httpx.get(f"{url}/stats", timeout=5).json()
    return stats["last_body"], stats["last_authorization"]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_every_field_reaches_the_upstream_unchanged(upstream: tuple[Gateway, str], stream: bool) -> None:
    gw, url = upstream
    sent = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": stream, **FIELDS}
    if stream:
        sent["stream_options"] = {"include_usage": False, "continuous_usage_stats": False}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=sent, timeout=30)
    assert resp.status_code == 200, resp.text
    body, authorization = recorded(url)
    expected = {**sent, "model": UPSTREAM_MODEL}   # the only change a plain request sees ...
    if stream:   # ... and on a stream the usage the gateway counts
        expected["stream_options"] = {**sent["stream_options"], "include_usage": True}
    assert body == expected
    assert list(body["messages"]) == MESSAGES
    assert authorization == f"Bearer {KEY}"


def test_continuous_usage_is_asked_of_the_upstream_only_with_usage(upstream: tuple[Gateway, str]) -> None:
    """The gateway asks every stream's usage of the upstream (it counts tokens by it); vLLM then puts usage
    in every chunk where `continuous_usage_stats` is on, which the relay passes on as sent: a client that
    asked for it without `include_usage` would get usage it did not ask for."""
    gw, url = upstream
    body = {"model": MODEL, "messages": MESSAGES[:2], "max_tokens": 3, "stream": True}
    for asked, upstream_gets in (({"continuous_usage_stats": True}, {"continuous_usage_stats": False}),
                                 ({"include_usage": True, "continuous_usage_stats": True},
                                  {"continuous_usage_stats": True})):
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json={**body, "stream_options": asked}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert recorded(url)[0]["stream_options"] == {**upstream_gets, "include_usage": True}, asked


def test_tool_calls_and_logprobs_reach_the_openai_client_whole(upstream: tuple[Gateway, str]) -> None:
    gw, _ = upstream
    completion = client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], tools=[WEATHER_TOOL],
                                                    max_tokens=5)
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls" and completion.model == MODEL
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    completion = client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], logprobs=True,
                                                    top_logprobs=1, max_tokens=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(t.token, t.logprob) for t in logprobs.content] == [("w0 ", -0.5), ("w1 ", -1.5), ("w2 ", -2.5)]
    assert logprobs.content[0].top_logprobs[0].token == "w0 "


def test_tool_calls_and_logprobs_reach_the_openai_client_streamed(upstream: tuple[Gateway, str]) -> None:
    gw, _ = upstream
    name, arguments, finish = "", "", None
    for chunk in client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], tools=[WEATHER_TOOL],
                                                    max_tokens=5, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                name += (delta.function and delta.function.name) or ""
                arguments += (delta.function and delta.function.arguments) or ""
            finish = choice.finish_reason or finish
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    tokens = []
    for chunk in client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], logprobs=True,
                                                    max_tokens=3, stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                tokens += [(t.token, t.logprob) for t in choice.logprobs.content]
    assert tokens == [("w0 ", -0.5), ("w1 ", -1.5), ("w2 ", -2.5)]


def test_several_choices_stream_to_their_end(upstream: tuple[Gateway, str]) -> None:
    gw, _ = upstream
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], n=3, max_tokens=4,
                                                    stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {i: "w0 w1 w2 w3 " for i in range(3)} and finishes == {i: "length" for i in range(3)}


def test_the_upstreams_cached_tokens_reach_the_client_streamed_and_not(upstream: tuple[Gateway, str]) -> None:
    """`usage.prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details): the
    gateway rebuilds a stream's usage event from what it counts, and keeps the upstream's figure."""
    gw, url = upstream
    httpx.post(f"{url}/control", json={"cached_tokens": 7}, timeout=5).raise_for_status()
    whole = client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], max_tokens=3)
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 7
    events = list(client(gw).chat.completions.create(model=MODEL, messages=MESSAGES[:2], max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True}))
    usage = events[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 7 and usage.completion_tokens == 3


def test_models_by_id(upstream: tuple[Gateway, str]) -> None:
    gw, _ = upstream
    assert client(gw).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(gw).models.retrieve("gpt-4o")


def test_the_gateways_engines_refuse_fields_they_cannot_honour(demo_gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER_TOOL], "logprobs": True}
    resp = httpx.post(f"{demo_gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "tools"
    for name in ("tools", "logprobs", "messages.2.tool_calls", "messages.3.tool_call_id"):
        assert name in error["message"]
    plain = {"model": MODEL, "messages": MESSAGES[:2], "max_tokens": 4, "n": 1, "logprobs": False}
    assert httpx.post(f"{demo_gateway.url}/v1/chat/completions", json=plain, timeout=30).status_code == 200


def test_an_isolated_tenants_salt_reaches_the_upstream(tmp_path: Path) -> None:
    """With tenants.isolate_prefix_cache the upstream gets the tenant's cache salt (vLLM's `cache_salt`),
    the client's own after it; nothing else of the body changes."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = spawn("tests.fake_openai_server", "--port", str(port))
    for name, secret in (("alpha", "sk-alpha"), ("admin", "sk-admin"), ("cluster", "cluster-secret")):
        (tmp_path / f"{name}.keys").write_text(f"{secret}\n")
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {
            "heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
            "auth": {"admin_keys_file": str(tmp_path / "admin.keys"),
                     "cluster_token_file": str(tmp_path / "cluster.keys")},
            "tenants": {"isolate_prefix_cache": True,
                        "teams": {"alpha": {"api_keys_file": str(tmp_path / "alpha.keys")}}}},
        "backends": [{"id": "recorder", "kind": "openai", "gpu": "H100", "address": url}],
    })
    try:
        with run_gateway(config, healthy=0, timeout=60, admin_key="sk-admin") as gw:
            for salt, sent in ((None, "tenant:alpha"), ("mine", "tenant:alpha:mine")):
                body = {"model": MODEL, "messages": MESSAGES[:2], "max_tokens": 3}
                if salt:
                    body["cache_salt"] = salt
                resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                                  headers={"authorization": "Bearer sk-alpha"})
                assert resp.status_code == 200, resp.text
                got, _ = recorded(url)
                assert got.pop("cache_salt") == sent
                assert got["messages"] == MESSAGES[:2] and got["model"] == MODEL
    finally:
        stop(engine)


def test_fields_only_an_upstream_honours_route_past_the_engines_beside_it(tmp_path: Path) -> None:
    """A model served by the gateway's engines and a kind: openai backend: a request with a seed, logprobs
    or several choices goes to the upstream, never to an engine that would refuse it with 400 (it did,
    whenever the router picked the engine)."""
    port = free_port()
    engine = spawn("tests.fake_openai_server", "--port", str(port))
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.2}},
                     {"id": "a100-0", "role": "language", "gpu": "A100-80GB", "launch": {"time_scale": 0.2}},
                     {"id": "upstream", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{port}",
                      "scrape": {"engine": "vllm", "interval_ms": 100}}]})
    asks = [{"seed": 7}, {"logprobs": True, "top_logprobs": 1}, {"n": 2}, {"top_k": 5}]
    try:
        with run_gateway(config, healthy=3, timeout=60) as gw:
            served = []
            for i in range(12):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4,
                        **asks[i % len(asks)]}
                resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
                assert resp.status_code == 200, resp.text
                if body.get("n") == 2:   # every choice's tokens (the demo upstream counted one choice's)
                    assert resp.json()["usage"]["completion_tokens"] == 8 and len(resp.json()["choices"]) == 2
                served.append(resp.headers["x-heterogate-backend"])
            assert set(served) == {"upstream"}
            plain = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert {httpx.post(f"{gw.url}/v1/chat/completions", json=plain, timeout=30).headers[
                "x-heterogate-backend"] for _ in range(12)} - {"upstream"}   # the engines still serve the rest
    finally:
        stop(engine)
