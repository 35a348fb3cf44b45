"""CORS (`gateway.cors`) on a real gateway: preflights before the key check, and the allow headers on
every kind of response (a route's JSON, errors, a stream, a refused request) to an allowed origin, none
to another origin or with CORS off.

Three gateways, one small managed engine each:
  keyed  two exact origins, credentials on, API keys on, a small body limit;
  star   every origin ("*"), `allow_headers: ["*"]`;
  off    no `cors` section: nothing changes (OPTIONS is a 405, no CORS header anywhere).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import Gateway, run_gateway, sse_payloads, write_config

MODEL = "llava-1.5-7b"
USER, ADMIN = "user-secret", "admin-secret"
APP, OTHER_APP, EVIL = "https://app.example.com", "http://localhost:5173", "https://evil.example"
CHAT = "/v1/chat/completions"
MAX_BODY_BYTES = 4096
EXPOSED = "x-request-id, x-heterogate-backend, x-heterogate-vision-backend, retry-after, x-should-retry"
ALLOWED_HEADERS = "authorization, content-type, x-request-id, x-request-timeout, x-session-id, traceparent, tracestate"

pytestmark = pytest.mark.timeout(120)


def _gateway(tmp: Path, **gateway: Any) -> Iterator[Gateway]:
    (tmp / "user.keys").write_text(f"{USER}\n")
    (tmp / "admin.keys").write_text(f"{ADMIN}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"auth": {"api_keys_file": str(tmp / "user.keys"), "admin_keys_file": str(tmp / "admin.keys"),
                             "cluster_token_file": str(tmp / "cluster.token")},
                    "limits": {"max_body_bytes": MAX_BODY_BYTES}, **gateway},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    with run_gateway(config, admin_key=ADMIN) as gw:
        yield gw


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # the second origin as written with its case and a default port: matched as a browser sends it
    yield from _gateway(tmp_path_factory.mktemp("cors-keyed"),
                        cors={"allow_origins": [APP, "HTTP://LocalHost:5173"], "allow_credentials": True})


@pytest.fixture(scope="module")
def star(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(tmp_path_factory.mktemp("cors-star"),
                        cors={"allow_origins": ["*"], "allow_headers": ["*"], "max_age_s": 60})


@pytest.fixture(scope="module")
def off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(tmp_path_factory.mktemp("cors-off"))


def preflight(gw: Gateway, path: str, origin: str, method: str = "POST", headers: str | None = None) -> httpx.Response:
    sent = {"origin": origin, "access-control-request-method": method}
    if headers is not None:
        sent["access-control-request-headers"] = headers
    return httpx.options(gw.url + path, headers=sent, timeout=10)


def chat(gw: Gateway, origin: str | None, *, key: str | None = USER, body: Any = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if origin is not None:
        headers["origin"] = origin
    body = body if body is not None else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 3}
    return httpx.post(gw.url + CHAT, json=body, headers=headers, timeout=30)


def cors_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("access-control-") or k == "vary"}


def allowed_for(origin: str, credentials: bool = True) -> dict[str, str]:
    headers = {"access-control-allow-origin": origin, "vary": "origin", "access-control-expose-headers": EXPOSED}
    if credentials:
        headers["access-control-allow-credentials"] = "true"
    return headers


# --- preflights ----------------------------------------------------------------------------------


def test_a_preflight_from_an_allowed_origin_gets_204_without_a_key(keyed: Gateway) -> None:
    for path, origin in ((CHAT, APP), ("/v1/models", OTHER_APP), ("/admin/backends", APP), ("/no/such/path", APP)):
        resp = preflight(keyed, path, origin, headers="authorization, content-type")
        assert resp.status_code == 204, (path, resp.text)
        assert resp.content == b"" and "content-length" not in resp.headers and "content-type" not in resp.headers
        assert cors_headers(resp) == {
            "access-control-allow-origin": origin, "vary": "origin, access-control-request-headers",
            "access-control-allow-methods": "GET, POST, DELETE",
            "access-control-allow-headers": ALLOWED_HEADERS,
            "access-control-max-age": "600", "access-control-allow-credentials": "true"}


def test_a_preflight_lists_the_sdk_headers_it_asked_for(keyed: Gateway) -> None:
    """The OpenAI JavaScript SDK's `x-stainless-*` headers, allowed by the default prefix, by name; a header
    nothing allows is left out (the browser then names it in its error)."""
    resp = preflight(keyed, CHAT, APP, headers="Authorization,X-Stainless-OS, x-stainless-retry-count,x-custom")
    assert resp.status_code == 204
    assert resp.headers["access-control-allow-headers"] == ALLOWED_HEADERS + ", x-stainless-os, x-stainless-retry-count"


def test_a_preflight_from_another_origin_is_refused(keyed: Gateway) -> None:
    for origin in (EVIL, APP + ":8443", "null", APP.upper()):
        resp = preflight(keyed, CHAT, origin)
        assert resp.status_code == 403, origin
        assert resp.json()["error"]["type"] == "permission_error"
        assert resp.json()["error"]["code"] == "origin_not_allowed"   # was admin_key_required
        assert f"origin {origin} is not allowed" in resp.json()["error"]["message"]
        assert cors_headers(resp) == {} and resp.headers["x-request-id"]


def test_options_without_the_preflight_headers_is_still_a_method_not_allowed(keyed: Gateway) -> None:
    resp = httpx.options(keyed.url + CHAT, headers={"origin": APP}, timeout=10)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert cors_headers(resp) == allowed_for(APP)   # an error to an allowed origin, readable by the page


def test_with_every_origin_allowed_a_preflight_echoes_what_it_asked_for(star: Gateway) -> None:
    resp = preflight(star, CHAT, EVIL, headers="authorization, content-type, x-stainless-os")
    assert resp.status_code == 204
    assert cors_headers(resp) == {
        "access-control-allow-origin": "*", "vary": "access-control-request-headers",
        "access-control-allow-methods": "GET, POST, DELETE",
        "access-control-allow-headers": "authorization, content-type, x-stainless-os",
        "access-control-max-age": "60"}


# --- responses to an allowed origin --------------------------------------------------------------


def test_a_json_reply_carries_the_headers(keyed: Gateway) -> None:
    resp = chat(keyed, APP)
    assert resp.status_code == 200 and resp.json()["choices"]
    assert cors_headers(resp) == allowed_for(APP)
    assert resp.headers["x-heterogate-backend"] == "h100-0"
    models = httpx.get(keyed.url + "/v1/models", headers={"origin": OTHER_APP, "authorization": f"Bearer {USER}"})
    assert models.status_code == 200 and cors_headers(models) == allowed_for(OTHER_APP)
    head = httpx.head(keyed.url + "/health", headers={"origin": APP})
    assert head.status_code == 200 and cors_headers(head) == allowed_for(APP)


@pytest.mark.parametrize(("key", "body", "status"), [
    pytest.param(None, None, 401, id="no-key"),
    pytest.param("wrong", None, 401, id="wrong-key"),
    pytest.param(USER, {"model": MODEL}, 400, id="no-messages"),
    pytest.param(USER, {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404, id="unknown-model"),
])
def test_error_replies_carry_the_headers(keyed: Gateway, key: str | None, body: Any, status: int) -> None:
    resp = chat(keyed, APP, key=key, body=body)
    assert resp.status_code == status and resp.json()["error"]["message"]
    assert cors_headers(resp) == allowed_for(APP)


def test_route_table_errors_carry_the_headers(keyed: Gateway) -> None:
    as_user = httpx.get(keyed.url + "/admin/backends", headers={"origin": APP, "authorization": f"Bearer {USER}"})
    assert as_user.status_code == 403 and cors_headers(as_user) == allowed_for(APP)
    missing = httpx.get(keyed.url + "/v2/nothing", headers={"origin": APP})
    assert missing.status_code == 404 and cors_headers(missing) == allowed_for(APP)


def test_a_request_refused_while_read_carries_the_headers(keyed: Gateway) -> None:
    """413: answered by the server itself, from the headers it read, before any route."""
    resp = chat(keyed, APP, body={"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]})
    assert resp.status_code == 413 and resp.json()["error"]["message"]
    assert cors_headers(resp) == allowed_for(APP)


def test_a_streamed_reply_carries_the_headers(keyed: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    headers = {"authorization": f"Bearer {USER}", "origin": APP}
    with httpx.stream("POST", keyed.url + CHAT, json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert cors_headers(resp) == allowed_for(APP)
        payloads = list(sse_payloads(resp.iter_lines()))
    assert payloads[-1] == "[DONE]" and len(payloads) > 2


def test_every_origin_gets_a_star_without_vary(star: Gateway) -> None:
    resp = chat(star, EVIL)
    assert resp.status_code == 200
    assert cors_headers(resp) == {"access-control-allow-origin": "*", "access-control-expose-headers": EXPOSED}
    assert cors_headers(chat(star, EVIL, key=None)) == cors_headers(resp)


def test_pipelined_requests_each_get_their_own_origins_headers(keyed: Gateway) -> None:
    """One connection, three requests sent at once: each response has the headers of its own request."""
    port = int(keyed.url.rsplit(":", 1)[1])
    request = "GET /health HTTP/1.1\r\nhost: x\r\n{}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall((request.format(f"origin: {APP}\r\n") + request.format(f"origin: {EVIL}\r\n")
                      + request.format(f"origin: {OTHER_APP}\r\nconnection: close\r\n")).encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    heads = [part for part in data.decode().split("HTTP/1.1 ")[1:]]
    assert len(heads) == 3 and all(h.startswith("200 ") for h in heads)
    assert f"access-control-allow-origin: {APP}\r\n" in heads[0]
    assert "access-control-" not in heads[1]
    assert f"access-control-allow-origin: {OTHER_APP}\r\n" in heads[2]


# --- nothing added -------------------------------------------------------------------------------


def test_no_headers_for_another_origin_or_none(keyed: Gateway) -> None:
    for origin in (EVIL, None):
        ok, refused = chat(keyed, origin), chat(keyed, origin, key=None)
        assert ok.status_code == 200 and refused.status_code == 401
        assert cors_headers(ok) == cors_headers(refused) == {}


def test_cors_off_changes_nothing(off: Gateway) -> None:
    resp = preflight(off, CHAT, APP)
    assert resp.status_code == 405 and cors_headers(resp) == {}
    for key, status in ((USER, 200), (None, 401)):
        reply = chat(off, APP, key=key)
        assert reply.status_code == status and cors_headers(reply) == {}
