"""OpenAI request fields a client moving from vLLM or OpenAI sends, on both kinds of backend: one gateway
on one simulated engine, one in front of `gateway demo-upstream` (the mock vLLM), both real processes on
127.0.0.1. Each field is either honoured, passed to the upstream that honours it, or refused with a 400
that names it, never silently dropped: `max_completion_tokens` on /v1/completions, the field an
over-long length names, stream options an engine cannot honour; prompts of token ids are served, bad ones named."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from backends.sim_executor import natural_length
from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config

MODEL = "llava-1.5-7b"
MAX_TOKENS = 4096   # the default limits.max_tokens, and the model's context
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway on one simulated language engine (fast clock)."""
    config = write_config(tmp_path_factory.mktemp("compat-engine"), {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.05}}],
    })
    with run_gateway(config, timeout=60) as gw:
        yield gw


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    """A gateway in front of the demo upstream, and the upstream's base URL (its /stats shows what it got)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([sys.executable, "-m", "gateway.cli", "demo-upstream", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert mock.poll() is None and time.monotonic() < deadline, "the demo upstream did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        config = write_config(tmp_path_factory.mktemp("compat-upstream"), {
            "model": MODEL, "gateway": {"heartbeat_interval_ms": 100},
            "backends": [{"id": "mock-vllm", "kind": "openai", "gpu": "H100", "address": url,
                          "upstream_model": "demo-model", "scrape": {"engine": "vllm", "interval_ms": 100}}],
        })
        with run_gateway(config, healthy=1, timeout=60) as gw:
            yield gw, url
    finally:
        mock.terminate()
        try:
            mock.wait(timeout=10)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait()


@pytest.fixture(params=["engine", "upstream"])
def gateway(request: pytest.FixtureRequest) -> Gateway:
    """Each of the two gateways in turn."""
    if request.param == "engine":
        return request.getfixturevalue("engine")
    return request.getfixturevalue("upstream")[0]


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=30)


def last_body(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats", timeout=5).json()["last_body"]


def test_a_history_with_an_assistant_refusal_part_is_served(gateway: Gateway) -> None:
    """OpenAI answers a refused request with a `refusal` part; a client sends it back in the history."""
    messages = [{"role": "user", "content": "something"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "user", "content": "then say hello"}]
    answer = post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    bad = [{"role": "assistant", "content": [{"type": "refusal", "refusal": 7}]}, messages[-1]]
    refused = post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": bad, "max_tokens": 2})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "messages.0.content: a refusal part's `refusal` should be a string"


def test_max_completion_tokens_bounds_a_text_completion(gateway: Gateway) -> None:
    """OpenAI's newer name for max_tokens bounds /v1/completions as it bounds chat (it went unread there:
    the completion ran to the gateway's default length, 16 tokens at least on the engine)."""
    sdk = client(gateway)
    reply = sdk.completions.create(model=MODEL, prompt="Hello", extra_body={"max_completion_tokens": 3})
    assert reply.usage is not None and reply.usage.completion_tokens == 3, reply
    assert reply.choices[0].finish_reason == "length"
    streamed = list(sdk.completions.create(model=MODEL, prompt="Hello", stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"max_completion_tokens": 2}))
    usage = streamed[-1].usage
    assert usage is not None and usage.completion_tokens == 2, streamed
    assert [c.finish_reason for s in streamed for c in s.choices if c.finish_reason] == ["length"]


def test_max_completion_tokens_goes_upstream_as_max_tokens_on_completions(upstream: tuple[Gateway, str]) -> None:
    gw, url = upstream
    assert post(gw, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_completion_tokens": 3}).status_code == 200
    got = last_body(url)
    assert got["max_tokens"] == 3 and "max_completion_tokens" not in got, got


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
], ids=["chat", "completions"])
def test_a_length_over_the_limits_names_the_field_the_client_sent(gateway: Gateway, path: str,
                                                                  body: dict[str, Any]) -> None:
    """The 400 names `max_completion_tokens` where the client asked with it, not `max_tokens`, which it
    never sent; over the limit and over the context alike."""
    for asked in (MAX_TOKENS + 1, MAX_TOKENS):   # over the limit; over the context with the prompt
        resp = post(gateway, path, {"model": MODEL, **body, "max_completion_tokens": asked})
        assert resp.status_code == 400, resp.text[:300]
        err = resp.json()["error"]
        assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"], err
        assert err["type"] == "invalid_request_error"
    resp = post(gateway, path, {"model": MODEL, **body, "max_tokens": MAX_TOKENS + 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text[:300]


def test_a_stream_option_an_engine_cannot_honour_is_refused_by_name(engine: Gateway) -> None:
    """vLLM's `continuous_usage_stats` puts usage in every chunk; an engine sends it only at the end, so
    it refuses the option (it answered as if it had not been asked). Asked off, it is no request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    resp = post(engine, "/v1/chat/completions",
                {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "stream_options.continuous_usage_stats", err
    assert "continuous_usage_stats" in err["message"] and "kind: openai" in err["message"], err
    resp = post(engine, "/v1/chat/completions",
                {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text


IDS = list(range(100, 200))   # 100 token ids


@pytest.mark.parametrize("prompt", [IDS, [IDS]], ids=["ids", "list-of-ids"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_token_ids_is_served_as_vllm_serves_it(gateway: Gateway, prompt: list[Any], stream: bool) -> None:
    """vLLM takes a prompt of token ids (`[1, 2]` or `[[1, 2]]`): counted as that many prompt tokens, and
    the same in the usage the client gets (the engine's count; the upstream's, which got the ids as sent)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    resp = post(gateway, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [orjson.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == len(IDS), usage


def test_the_upstream_gets_the_token_ids_as_sent(upstream: tuple[Gateway, str]) -> None:
    gw, url = upstream
    assert post(gw, "/v1/completions", {"model": MODEL, "prompt": [IDS], "max_tokens": 2}).status_code == 200
    assert last_body(url)["prompt"] == [IDS]


@pytest.mark.parametrize(("prompt", "message"), [
    ([[1, 2], [3, 4]], "batched prompts are not supported"),
    ([[]], "non-empty list of integers"),
    ([1, -2], "integers in [0, 2^32)"),
    ([1, 2.5], "integers in [0, 2^32)"),
    ([True, 1], "integers in [0, 2^32)"),
    ([1.0, 2], "integers in [0, 2^32)"),
    ([1, 1 << 32], "integers in [0, 2^32)"),
    ([], "must not be empty"),
])
def test_a_bad_prompt_of_token_ids_is_named(engine: Gateway, prompt: list[Any], message: str) -> None:
    resp = post(engine, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt" and message in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("stop", "text", "tokens"), [
    (["model"], "the ", 2),
    ([" with", "answers"], "the model ", 3),          # the first to occur wins, the text cut before it
    (["tokens from a h"], "the model answers with simulated ", 9),
])
def test_a_simulated_engine_ends_at_a_stop_string(engine: Gateway, stream: bool, stop: list[str], text: str,
                                                   tokens: int) -> None:
    """The simulated engine's made-up words hold the stop strings asked here: the text ends before the
    first, finish_reason "stop", usage counts the tokens up to the one that completed it; streamed or whole,
    chat or completions."""
    c = client(engine)
    for chat in (True, False):
        if chat:
            out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                            stop=stop, stream=stream, stream_options={"include_usage": True}
                                            if stream else None)
        else:
            out = c.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop=stop, stream=stream,
                                       stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(out)
            got = "".join((ch.choices[0].delta.content or "") if chat else ch.choices[0].text
                          for ch in chunks if ch.choices)
            finish = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
            usage = chunks[-1].usage
        else:
            got = out.choices[0].message.content if chat else out.choices[0].text
            finish, usage = out.choices[0].finish_reason, out.usage
        assert (got, finish) == (text, "stop"), (chat, got, finish)
        assert usage is not None and usage.completion_tokens == tokens


def test_a_stop_string_that_does_not_occur_or_comes_too_late_changes_nothing(engine: Gateway) -> None:
    c = client(engine)
    never = c.completions.create(model=MODEL, prompt="hi", max_tokens=5, stop=["zzz"])
    assert never.choices[0].text == "the model answers with simulated " and never.choices[0].finish_reason == "length"
    late = c.completions.create(model=MODEL, prompt="hi", max_tokens=3, stop=["simulated"])
    assert late.choices[0].text == "the model answers " and late.choices[0].finish_reason == "length"
    many = c.completions.create(model=MODEL, prompt="hi", max_tokens=5, stop=[f"z{k}" for k in range(16)])
    assert many.choices[0].finish_reason == "length"   # OpenAI takes 4, vLLM any: up to limits.max_stop_strings


def test_more_stop_strings_than_the_limit_is_a_400_naming_stop(engine: Gateway) -> None:
    """Each stop string is checked at every token: a body of a million (well within the body limit) made an
    engine's work per token a million times larger."""
    resp = httpx.post(f"{engine.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [f"z{k}" for k in range(17)]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert "stop has 17 strings; the limit is 16" in resp.json()["error"]["message"]


def test_no_request_gets_more_than_max_tokens_by_default(tmp_path: Path) -> None:
    """`limits.max_tokens` below the default length: a request that names no length gets at most the cap
    (before, the default 256 went past it). The request id is one the simulated engine would answer at
    length with more tokens than the cap."""
    request_id = next(f"cap-{k}" for k in range(1000) if natural_length(f"cap-{k}") > 150)
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "limits": {"max_tokens": 100}},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.02}}],
    })
    with run_gateway(config, timeout=60) as gw:
        resp = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                          headers={"x-request-id": request_id}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 100 and resp.json()["choices"][0]["finish_reason"] == "length"
