"""Bad-input fuzzing of the HTTP door with hypothesis: no 5xx, no hang, other requests unaffected.

Bodies are random JSON values and valid requests with fields replaced by random values of any type;
raw bytes that are not JSON at all are sent too. Every answer must be a 2xx or a 4xx with an OpenAI
error body, within the client timeout, while a valid request keeps succeeding in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.harness import Gateway, run_gateway, write_config

MODEL = "llava-1.5-7b"
EXAMPLES = 150
SENT: dict[str, int] = {"count": 0}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
VALID_CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
VALID_TEXT: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    body = dict(valid)
    keys = [*valid, "messages", "stream", "temperature", "n", "stop", "stream_options", "max_completion_tokens"]
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
        body[key] = draw(json_values)
    return body


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"limits": {"max_tokens": 64, "max_body_bytes": 65536}},
        "backends": [{"id": "h100-0", "gpu": "H100", "launch": {"time_scale": 0.01}}],
    })
    with run_gateway(config) as gw, gw.client(timeout=15) as client:
        gw.http = client  # type: ignore[attr-defined]
        yield gw
    print(f"\nfuzzing: {SENT['count']} bad requests sent")


def check(gw: Gateway, path: str, content: bytes) -> None:
    client: httpx.Client = gw.http  # type: ignore[attr-defined]
    resp = client.post(path, content=content, headers={"content-type": "application/json"})
    SENT["count"] += 1
    assert resp.status_code < 500, (resp.status_code, content[:200], resp.text[:200])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"]
    assert resp.headers["x-request-id"]


def valid_still_works(gw: Gateway) -> None:
    client: httpx.Client = gw.http  # type: ignore[attr-defined]
    assert client.post("/v1/chat/completions", json=VALID_CHAT).status_code == 200


_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(body=json_values | mutated(VALID_CHAT))
def test_chat_bodies(gateway: Gateway, body: Any) -> None:
    check(gateway, "/v1/chat/completions", orjson.dumps(body))


@_SETTINGS
@given(body=json_values | mutated(VALID_TEXT))
def test_completion_bodies(gateway: Gateway, body: Any) -> None:
    check(gateway, "/v1/completions", orjson.dumps(body))


@_SETTINGS
@given(raw=st.binary(max_size=300))
def test_raw_bytes(gateway: Gateway, raw: bytes) -> None:
    check(gateway, "/v1/chat/completions", raw)


def test_valid_requests_unaffected(gateway: Gateway) -> None:
    for _ in range(5):
        valid_still_works(gateway)
