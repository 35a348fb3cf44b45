"""Every error path of the HTTP door: status, OpenAI-shaped body, x-request-id, and what the engines see.

Three gateways, each shared by the tests of one kind:
  limits    one slow managed engine (L4, real time), small limits: validation errors and disconnects;
  nobackend one external backend where nothing listens, so nothing ever heartbeats: 503;
  failover  two slow managed engines, round robin, 0.5 s first-token timeout, heartbeats every 2 s
            (so a stopped engine stays a candidate long enough to time out): retries and mid-stream
            failures.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
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
    engine_pid,
    free_port,
    long_request_id,
    metric_total,
    run_gateway,
    short_request_id,
    sigstopped,
    sse_payloads,
    wait_all_healthy,
    write_config,
)

MODEL = "llava-1.5-7b"
MAX_PROMPT_TOKENS = 64
MAX_TOKENS = 512
MAX_BODY_BYTES = 16_384
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Natural length of the long generations: ≥ 250 tokens at ~48 ms a token on a simulated L4, ~12 s.
LONG_TOKENS = 250

pytestmark = pytest.mark.timeout(60)


# --- gateways ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limits_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("limits")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "heartbeat_interval_ms": 100,
            "limits": {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                       "max_body_bytes": MAX_BODY_BYTES},
            # Remote image URLs on, so that the loopback refusal (not the switch) is what is tested.
            "images": {"remote_urls": True},
        },
        # role both: it encodes the images the tests send (a language engine alone serves the model text only)
        "backends": [{"id": "l4-0", "role": "both", "gpu": "L4", "launch": {"time_scale": 1.0}}],
    })
    with run_gateway(config, "--log-level", "info") as gw:   # the request lines
        yield gw


@pytest.fixture(scope="module")
def nobackend_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("nobackend")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100},
        "backends": [{"id": "ext-0", "gpu": "L4", "address": f"127.0.0.1:{free_port()}"}],
    })
    with run_gateway(config, healthy=0) as gw:
        yield gw


@pytest.fixture(scope="module")
def failover_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("failover")
    launch = {"time_scale": 1.0}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 2000, "limits": {"first_token_timeout_s": 0.5}},
        "backends": [{"id": "a", "gpu": "L4", "launch": launch}, {"id": "b", "gpu": "L4", "launch": launch}],
    })
    with run_gateway(config, "--policy", "round_robin") as gw:
        yield gw


# --- helpers -------------------------------------------------------------------------------------


def chat(content: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def completion(prompt: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **extra}


def assert_openai_error(
    r: httpx.Response, status: int, *, type_: str | None = None, param: Any = ..., code: Any = ...
) -> dict[str, Any]:
    """Status, the exact OpenAI error shape, JSON content type and an x-request-id; returns the error."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers.get("x-request-id"), dict(r.headers)
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if type_ is not None:
        assert err["type"] == type_, err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return dict(err)


def post(gw: Gateway, path: str, **kwargs: Any) -> httpx.Response:
    with gw.client(timeout=15) as c:
        return c.post(path, **kwargs)


# --- malformed and mistyped bodies ---------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_malformed_json_is_400(limits_gw: Gateway, path: str) -> None:
    raw = b'{"model": "llava-1.5-7b", "messages": ['
    r = post(limits_gw, path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, type_="invalid_request_error", param=None)


def test_a_compressed_or_non_utf8_body_is_named_as_such(limits_gw: Gateway) -> None:
    """Both were "not valid JSON: str is not valid UTF-8: surrogates not allowed"."""
    body = json.dumps(chat()).encode()
    gzipped = post(limits_gw, CHAT, content=gzip.compress(body),
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    err = assert_openai_error(gzipped, 415, type_="invalid_request_error", param="content-encoding")
    assert "content-encoding 'gzip' is not supported" in err["message"]
    latin = post(limits_gw, CHAT, content=body.replace(b"hello", "h\u00e9llo".encode("latin-1")),
                 headers={"content-type": "application/json"})
    assert "not valid JSON: it is not UTF-8 text" in assert_openai_error(latin, 400, param=None)["message"]
    identity = post(limits_gw, CHAT, content=body,
                    headers={"content-type": "application/json", "content-encoding": "identity"})
    assert identity.status_code == 200, identity.text


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"a string"', b"null", b"42"])
def test_non_object_json_is_400(limits_gw: Gateway, raw: bytes) -> None:
    r = post(limits_gw, CHAT, content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, type_="invalid_request_error", param=None)
    assert "object" in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat(max_tokens="5"), "max_tokens"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, {"model": MODEL, "messages": "hello"}, "messages"),
    (CHAT, {"model": MODEL, "messages": {"role": "user", "content": "hello"}}, "messages"),
    (CHAT, {"model": 7, "messages": [{"role": "user", "content": "hello"}]}, "model"),
    (COMPLETIONS, completion(max_tokens="5"), "max_tokens"),
    (COMPLETIONS, completion(prompt=5), "prompt"),
], ids=["max_tokens-str", "temperature-str", "stream-str", "messages-str", "messages-dict", "model-int",
        "completions-max_tokens-str", "completions-prompt-int"])
def test_wrong_types_are_400_naming_the_field(limits_gw: Gateway, path: str, body: dict[str, Any], param: str) -> None:
    r = post(limits_gw, path, json=body)
    err = assert_openai_error(r, 400, type_="invalid_request_error")
    assert err["param"] is not None and err["param"].split(".")[0] == param, err


@pytest.mark.parametrize(("content", "param", "words"), [
    ([{"type": "image_url", "image_url": {}}], "messages.0.content.0.image_url.url", "Field required"),
    ([{"type": "text"}], "messages.0.content.0.text", "Field required"),
    ([{"type": "audio"}], "messages.0.content.0",
     "`type` should be one of 'text', 'image_url' or 'refusal', not 'audio'"),
    ([{"text": "x"}], "messages.0.content.0", "an object with a `type` field"),   # was "...discriminator 'type'"
    (5, "messages.0.content", "a valid string, or a valid list"),
], ids=["image-part-without-url", "text-part-without-text", "unknown-part", "part-without-type", "neither-shape"])
def test_a_malformed_content_part_is_named(limits_gw: Gateway, content: Any, param: str, words: str) -> None:
    """The error is the part's own, not that `content` should have been a string."""
    err = assert_openai_error(post(limits_gw, CHAT, json=chat(content)), 400, type_="invalid_request_error",
                              param=param)
    assert words in err["message"], err


def test_a_message_that_is_no_object_is_said_so_without_class_names(limits_gw: Gateway) -> None:
    err = assert_openai_error(post(limits_gw, CHAT, json={"model": MODEL, "messages": ["hi"]}), 400,
                              param="messages.0")
    assert err["message"] == "messages.0: Input should be a JSON object", err   # was "...instance of ChatMessage"


def test_null_stream_is_not_streamed_and_what_is_not_done_is_400(limits_gw: Gateway) -> None:
    r = post(limits_gw, CHAT, json=chat(stream=None, max_tokens=2))
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    err = assert_openai_error(post(limits_gw, COMPLETIONS, json=completion(echo=True, max_tokens=2)), 400,
                              param="echo")
    assert "cannot honour echo" in err["message"]
    assert post(limits_gw, COMPLETIONS, json=completion(echo=False, max_tokens=2)).status_code == 200
    assert_openai_error(post(limits_gw, CHAT, json=chat(prompt="ignored?", max_tokens=2)), 400, param="prompt")
    assert_openai_error(post(limits_gw, CHAT, json=chat(stream_options={"include_usage": True}, max_tokens=2)), 400,
                        param="stream_options")


def test_empty_messages_is_400(limits_gw: Gateway) -> None:
    r = post(limits_gw, CHAT, json={"model": MODEL, "messages": []})
    assert_openai_error(r, 400, type_="invalid_request_error", param="messages")


@pytest.mark.parametrize("content", [None, []])
def test_a_user_message_without_content_is_400_and_an_assistants_is_not(limits_gw: Gateway, content: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content},
                {"role": "user", "content": content}]
    assert_openai_error(post(limits_gw, CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2}), 400,
                        param="messages.2.content")
    messages[2]["content"] = "and?"
    assert post(limits_gw, CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(("path", "field"), [(CHAT, "n"), (COMPLETIONS, "n"), (COMPLETIONS, "best_of")])
def test_more_choices_than_the_limit_is_400_naming_the_field(limits_gw: Gateway, path: str, field: str) -> None:
    """`limits.max_choices` (8) bounds `n` and a completion's `best_of` alike: each makes as many generations."""
    body = {"model": MODEL, "max_tokens": 2, field: 9,
            **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})}
    r = post(limits_gw, path, json=body)
    assert_openai_error(r, 400, param=field)
    assert "the limit is 8" in r.json()["error"]["message"]


def test_missing_messages_is_400(limits_gw: Gateway) -> None:
    r = post(limits_gw, CHAT, json={"model": MODEL})
    assert_openai_error(r, 400, type_="invalid_request_error", param="messages")


def test_given_request_id_is_echoed_on_errors(limits_gw: Gateway) -> None:
    r = post(limits_gw, CHAT, json={"model": MODEL, "messages": []}, headers={"x-request-id": "err-echo-1"})
    assert_openai_error(r, 400)
    assert r.headers["x-request-id"] == "err-echo-1"


# --- model and limits ----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat()), (COMPLETIONS, completion())])
def test_unknown_model_is_404(limits_gw: Gateway, path: str, body: dict[str, Any]) -> None:
    r = post(limits_gw, path, json={**body, "model": "gpt-17"})
    err = assert_openai_error(r, 404, type_="invalid_request_error", param="model", code="model_not_found")
    assert "gpt-17" in err["message"]


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, chat(max_tokens=MAX_TOKENS + 1)),
    (CHAT, chat(max_completion_tokens=MAX_TOKENS + 1)),
    (COMPLETIONS, completion(max_tokens=MAX_TOKENS + 1)),
], ids=["chat", "chat-max_completion_tokens", "completions"])
def test_max_tokens_over_the_limit_is_400(limits_gw: Gateway, path: str, body: dict[str, Any]) -> None:
    r = post(limits_gw, path, json=body)
    err = assert_openai_error(r, 400, type_="invalid_request_error")
    assert err["param"] in {"max_tokens", "max_completion_tokens"}, err
    assert str(MAX_TOKENS) in err["message"]


@pytest.mark.parametrize(("path", "field"), [(CHAT, "max_tokens"), (CHAT, "seed"), (COMPLETIONS, "best_of")])
def test_an_integer_past_64_bits_is_said_to_be_too_large(limits_gw: Gateway, path: str, field: str) -> None:
    """Read as a float by the JSON parser, it was "Input should be a valid integer"."""
    body = chat() if path == CHAT else completion()
    r = post(limits_gw, path, json={**body, field: 10 ** 30})
    err = assert_openai_error(r, 400, type_="invalid_request_error", param=field)
    assert "too large" in err["message"], err


def test_a_seed_past_a_signed_64_bit_integer_is_400_naming_the_bound(limits_gw: Gateway) -> None:
    """2^63 passed the check and broke building a torch engine's request (its seed is an int64): a 500."""
    r = post(limits_gw, CHAT, json={**chat(), "seed": 2 ** 63})
    err = assert_openai_error(r, 400, type_="invalid_request_error", param="seed")
    assert "less than or equal to 9223372036854775807" in err["message"], err


def test_max_tokens_at_the_limit_is_accepted(limits_gw: Gateway) -> None:
    rid = short_request_id(20)   # the engine stops it early: the test is about admission, not length
    r = post(limits_gw, COMPLETIONS, json=completion(max_tokens=MAX_TOKENS), headers={"x-request-id": rid})
    assert r.status_code == 200, r.text


def test_chat_prompt_over_the_limit_is_400(limits_gw: Gateway) -> None:
    r = post(limits_gw, CHAT, json=chat("x" * (4 * MAX_PROMPT_TOKENS + 40)))
    err = assert_openai_error(r, 400, type_="invalid_request_error", param="messages", code="context_length_exceeded")
    assert str(MAX_PROMPT_TOKENS) in err["message"]


def test_completions_prompt_over_the_limit_is_400_naming_prompt(limits_gw: Gateway) -> None:
    r = post(limits_gw, COMPLETIONS, json=completion("x" * (4 * MAX_PROMPT_TOKENS + 40)))
    # /v1/completions has no `messages`: the offending field is `prompt`.
    assert_openai_error(r, 400, type_="invalid_request_error", param="prompt", code="context_length_exceeded")


def test_body_over_max_body_bytes_is_413(limits_gw: Gateway) -> None:
    """... and counted and logged as every request is (no handler sees it: there was no trace of it)."""
    before = metric_total(limits_gw, "heterogate_requests_total", endpoint="chat", status="413")
    rid = "too-large-body"
    r = post(limits_gw, CHAT, json=chat("y" * (MAX_BODY_BYTES + 100)), headers={"x-request-id": rid})
    assert_openai_error(r, 413, type_="invalid_request_error", code="payload_too_large")
    assert metric_total(limits_gw, "heterogate_requests_total", endpoint="chat", status="413") == before + 1

    def logged() -> list[dict[str, Any]]:
        lines = [json.loads(ln) for ln in limits_gw.log_path.read_text().splitlines() if ln.startswith("{")]
        return [ln for ln in lines if ln.get("event") == "request" and ln.get("request_id") == rid]

    line = limits_gw.wait_until(logged, timeout=5)[0]
    assert line["status"] == 413 and "limit" in line["error"], line


def test_grpc_door_honours_max_body_bytes_and_max_prompt_tokens(limits_gw: Gateway) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{limits_gw.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for size, code in ((MAX_BODY_BYTES + 100, grpc.StatusCode.RESOURCE_EXHAUSTED),
                           (4 * MAX_PROMPT_TOKENS + 40, grpc.StatusCode.INVALID_ARGUMENT)):
            request = inference_pb2.GenerateRequest(model=MODEL, prompt="x" * size, max_tokens=2)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == code, (size, info.value)


def test_chunked_body_over_max_body_bytes_is_413(limits_gw: Gateway) -> None:
    """No content-length to trust: the cap applies while reading."""
    raw = json.dumps(chat("z" * (MAX_BODY_BYTES + 100))).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 1024):
            yield raw[i:i + 1024]

    r = post(limits_gw, CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, type_="invalid_request_error", code="payload_too_large")


# --- images --------------------------------------------------------------------------------------


def recording_server(hits: list[str]) -> ThreadingHTTPServer:
    """A loopback HTTP server that serves a tiny PNG and records every path asked for."""

    class Recorder(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()
            self.wfile.write(b"\x89PNG\r\n\x1a\n")

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Recorder)


def test_image_url_to_a_local_http_address_is_400_naming_the_part(limits_gw: Gateway) -> None:
    """A remote (non-data:) URL at a loopback address is refused, never fetched, and the part is named."""
    hits: list[str] = []
    server = recording_server(hits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        r = post(limits_gw, CHAT, json=chat(content, max_tokens=4))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    err = assert_openai_error(r, 400, type_="invalid_request_error")
    assert err["param"] is not None and err["param"].startswith("messages.0.content.1"), err
    assert hits == [], f"the gateway fetched {hits}"


# --- routes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/nope", "/v2/chat/completions", "/"])
def test_unknown_route_is_404_with_an_openai_body(limits_gw: Gateway, path: str) -> None:
    with limits_gw.client(timeout=10) as c:
        assert_openai_error(c.post(path, json=chat()), 404)
        assert_openai_error(c.get(path), 404)


def test_wrong_method_is_405_with_an_openai_body(limits_gw: Gateway) -> None:
    with limits_gw.client(timeout=10) as c:
        assert_openai_error(c.get(CHAT), 405)


# --- no backend ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, chat(max_tokens=4)),
    (CHAT, chat(max_tokens=4, stream=True)),
    (COMPLETIONS, completion(max_tokens=4)),
], ids=["chat", "chat-stream", "completions"])
def test_no_healthy_backend_is_503_with_retry_after(nobackend_gw: Gateway, path: str, body: dict[str, Any]) -> None:
    assert not any(b["healthy"] for b in nobackend_gw.backends())
    r = post(nobackend_gw, path, json=body)
    assert_openai_error(r, 503, code="no_backend_available")
    assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(f"{nobackend_gw.url}/ready", timeout=5).status_code == 503


# --- backend failures ----------------------------------------------------------------------------


def test_failure_before_the_first_token_is_retried_on_another_backend(failover_gw: Gateway) -> None:
    wait_all_healthy(failover_gw)
    before = metric_total(failover_gw, "heterogate_dispatch_retries_total")
    before_b = metric_total(failover_gw, "heterogate_dispatch_retries_total", backend="b")
    with sigstopped(engine_pid(failover_gw, "b")):
        served = []
        for i in range(2):   # round robin: at least one of the two is sent to `b` first
            r = post(failover_gw, COMPLETIONS, json=completion(f"retry {i}", max_tokens=2))
            assert r.status_code == 200, r.text
            served.append(r.headers["x-heterogate-backend"])
        assert failover_gw.backend("b")["healthy"], "b left the candidate set: the retry path was not exercised"
    assert served == ["a", "a"]
    assert metric_total(failover_gw, "heterogate_dispatch_retries_total") > before
    assert metric_total(failover_gw, "heterogate_dispatch_retries_total", backend="b") > before_b
    failover_gw.wait_until(lambda: all(b["in_flight"] == 0 for b in failover_gw.backends()), timeout=5)


def test_every_attempt_timing_out_is_504(failover_gw: Gateway) -> None:
    wait_all_healthy(failover_gw)
    with sigstopped(engine_pid(failover_gw, "a")), sigstopped(engine_pid(failover_gw, "b")):
        r = post(failover_gw, CHAT, json=chat(max_tokens=2))
    assert_openai_error(r, 504, code="backend_timeout")
    failover_gw.wait_until(lambda: all(b["in_flight"] == 0 for b in failover_gw.backends()), timeout=5)


def test_failure_after_the_first_token_ends_the_stream_with_an_error_event(failover_gw: Gateway) -> None:
    wait_all_healthy(failover_gw)
    rid = long_request_id(LONG_TOKENS, prefix="midstream")
    payloads: list[str] = []
    with httpx.Client(base_url=failover_gw.url, timeout=15) as c, c.stream(
        "POST", CHAT, json=chat(max_tokens=MAX_TOKENS, stream=True), headers={"x-request-id": rid}
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-request-id"] == rid
        backend = r.headers["x-heterogate-backend"]
        pid = engine_pid(failover_gw, backend)
        events = sse_payloads(r.iter_lines())
        for payload in events:
            payloads.append(payload)
            if len(payloads) == 4:   # the role chunk and three tokens
                os.kill(pid, signal.SIGKILL)
                break
        payloads.extend(events)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    decoded = [json.loads(p) for p in payloads[:-1]]
    errors = [e["error"] for e in decoded if "error" in e]
    assert len(errors) == 1, decoded[-3:]
    assert "error" in decoded[-1], "the error event must be the last event before [DONE]"
    assert set(errors[0]) == {"message", "type", "param", "code"}
    assert errors[0]["code"] == "backend_failure" and backend in errors[0]["message"], errors[0]
    tokens = [e for e in decoded if "choices" in e]
    assert all(c["finish_reason"] is None for e in tokens for c in e["choices"]), "finished despite the failure"
    assert len(tokens) < LONG_TOKENS

    def restarted() -> bool:
        b = failover_gw.backend(backend)
        return bool(b["healthy"] and b["pid"] not in (None, pid) and b["in_flight"] == 0)

    failover_gw.wait_until(restarted, timeout=20)


def test_failure_mid_generation_of_a_non_streamed_request_starts_it_over_elsewhere(failover_gw: Gateway) -> None:
    """Nothing has reached the client yet, so the client gets one whole answer from the other backend."""
    gw = failover_gw
    wait_all_healthy(gw)
    ids = [b["id"] for b in gw.backends()]
    ttft = "heterogate_ttft_seconds_count"
    firsts = {i: metric_total(gw, ttft, backend=i) for i in ids}
    retries = {i: metric_total(gw, "heterogate_dispatch_retries_total", backend=i) for i in ids}
    rid = long_request_id(LONG_TOKENS, prefix="midplain")
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(
        post(gw, COMPLETIONS, json=completion(max_tokens=40), headers={"x-request-id": rid})
    ))
    sender.start()
    try:
        # The gateway holds the first token once its TTFT is observed: from then on the failure is mid-generation.
        first = gw.wait_until(lambda: next((i for i in ids if metric_total(gw, ttft, backend=i) > firsts[i]), None),
                              timeout=10, interval=0.01)
        pid = engine_pid(gw, first)
        os.kill(pid, signal.SIGKILL)
    finally:
        sender.join(timeout=30)
    assert answer, "the request did not finish"
    r = answer[0]
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert r.headers["x-heterogate-backend"] != first
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 40 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 40
    assert metric_total(gw, "heterogate_dispatch_retries_total", backend=first) > retries[first]

    def restarted() -> bool:
        b = gw.backend(first)
        return bool(b["healthy"] and b["pid"] not in (None, pid))

    gw.wait_until(restarted, timeout=20)
    gw.wait_until(lambda: all(b["in_flight"] == 0 for b in gw.backends()), timeout=5)


# --- client disconnects --------------------------------------------------------------------------


def test_client_disconnect_during_a_stream_cancels_the_generation(limits_gw: Gateway) -> None:
    gw = limits_gw
    tokens_before = _idle_engine(gw)["tokens_generated"]
    rid = long_request_id(LONG_TOKENS, prefix="disconnect-stream")
    with httpx.Client(base_url=gw.url, timeout=15) as c, c.stream(
        "POST", CHAT, json=chat(max_tokens=MAX_TOKENS, stream=True), headers={"x-request-id": rid}
    ) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
        for _ in range(4):   # the role chunk and three tokens
            assert next(events) != "[DONE]"
        assert _engine(gw)["in_flight"] == 1
        gw.wait_until(lambda: _engine(gw)["running"] == 1, timeout=5)
    # Leaving both blocks closed the response and its connection mid-stream.
    _assert_cancelled(gw, tokens_before)


def test_client_disconnect_while_waiting_for_a_completion_cancels_the_generation(limits_gw: Gateway) -> None:
    gw = limits_gw
    tokens_before = _idle_engine(gw)["tokens_generated"]
    rid = long_request_id(LONG_TOKENS, prefix="disconnect-plain")
    gone_before = metric_total(gw, "heterogate_requests_total", endpoint="chat", status="499")
    raw = json.dumps(chat(max_tokens=MAX_TOKENS)).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {CHAT} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\ncontent-length: {len(raw)}\r\n\r\n".encode() + raw
        )
        gw.wait_until(lambda: (b := _engine(gw))["running"] == 1 and b["in_flight"] == 1, timeout=5)
    _assert_cancelled(gw, tokens_before)
    gw.wait_until(lambda: metric_total(gw, "heterogate_requests_total", endpoint="chat", status="499") > gone_before)
    assert "Traceback" not in gw.log_path.read_text()   # a client leaving is not an error of the gateway's


def _engine(gw: Gateway) -> dict[str, Any]:
    return gw.backend("l4-0")


def _idle_engine(gw: Gateway) -> dict[str, Any]:
    return dict(gw.wait_until(
        lambda: (b := _engine(gw))["healthy"] and b["running"] == 0 and b["waiting"] == 0 and b["in_flight"] == 0 and b,
        timeout=15,
    ))


def _assert_cancelled(gw: Gateway, tokens_before: int) -> None:
    # The whole generation takes ~12 s on this engine; its cancellation, a heartbeat or two.
    gw.wait_until(lambda: (b := _engine(gw))["running"] == 0 and b["in_flight"] == 0, timeout=4)
    generated = _engine(gw)["tokens_generated"] - tokens_before
    assert generated < LONG_TOKENS // 2, f"the engine went on generating ({generated} tokens) after the disconnect"
