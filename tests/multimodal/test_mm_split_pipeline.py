"""Modality-level split end to end: one real gateway, one language engine, two vision engines.

    h100-0      language  H100      max_batch 1 (so text requests queue up: backlog ≥ τ = 4)
    rtx4090-a   vision    RTX-4090  steal: true (decoder loaded), but gateway.stealing.enabled: false
    rtx4090-b   vision    RTX-4090  steal: true

Image requests are encoded on an RTX 4090 and the 576 × 4096 × 2-byte embedding per image (LLaVA-1.5-7B)
goes straight to the H100; text-only requests never touch the vision pool. handoff_timeout_s is 1 s and
heartbeats may lapse for 2 s (20 × 100 ms), so a killed or stopped vision engine is still a candidate
for the next request, which must then be re-encoded on the other one (and a pool silent for up to 2.5 s,
`heartbeat_fail_open_s`, is still tried). Remote image URLs are on with
private addresses allowed, so a loopback image server can be fetched from.

The fault-injection tests come last: they kill / stop vision engines and wait for them to come back.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from common.wire import engine_pb2, engine_pb2_grpc
from testkit.harness import (
    Gateway,
    data_url,
    engine_pid,
    image_bytes,
    image_part,
    long_request_id,
    metric_total,
    run_gateway,
    serving_images,
    sigstopped,
    sse_payloads,
    text_part,
    wait_all_healthy,
    without_images,
    write_config,
)

MODEL = "llava-1.5-7b"
LANGUAGE = "h100-0"
VISION_A, VISION_B = "rtx4090-a", "rtx4090-b"
VISION = (VISION_A, VISION_B)
TAU = 4
IMAGE_TOKENS = 576
EMBEDDING_BYTES = 576 * 4096 * 2   # LLaVA-1.5-7B: tokens × hidden × fp16 bytes = 4,718,592
CHAT = "/v1/chat/completions"
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]
VISION_COUNTERS = ("images_encoded", "embedding_bytes_sent", "requests_completed", "tokens_generated",
                   "steal_episodes", "tokens_stolen")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("split")
    launch = {"time_scale": 0.5}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "heartbeat_interval_ms": 100,
            "heartbeat_miss_limit": 20,
            "heartbeat_fail_open_s": 2.5,
            "handoff_timeout_s": 1.0,
            "stealing": {"enabled": False, "threshold": TAU},
            "images": {"remote_urls": True, "allow_private_addresses": True},
            "breaker": {"failure_threshold": 3, "open_s": 10.0},
            "routing": {"policy": "heteroserve", "vision_policy": "encode_cost"},
        },
        "backends": [
            {"id": LANGUAGE, "role": "language", "gpu": "H100", "launch": {**launch, "max_batch": 1}},
            {"id": VISION_A, "role": "vision", "gpu": "RTX-4090", "steal": True, "launch": launch},
            {"id": VISION_B, "role": "vision", "gpu": "RTX-4090", "steal": True, "launch": launch},
        ],
    })
    with run_gateway(config) as g:
        yield g


def post_chat(gw: Gateway, messages: list[dict[str, Any]], *, max_tokens: int = 4, request_id: str | None = None,
              **extra: Any) -> httpx.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}
    return httpx.post(f"{gw.url}{CHAT}", json=body, headers=headers, timeout=30)


def text_tokens(gw: Gateway, messages: list[dict[str, Any]]) -> int:
    """prompt_tokens of the same conversation with its images removed."""
    r = post_chat(gw, without_images(messages), max_tokens=1)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def by_id(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {b["id"]: b for b in gw.backends()}


def vision_counters(gw: Gateway) -> dict[str, dict[str, int]]:
    backends = by_id(gw)
    return {v: {k: backends[v][k] for k in VISION_COUNTERS} for v in VISION}


PNG, JPEG, WEBP = ("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")


def url_of(kind: tuple[str, str], size: tuple[int, int], seed: int = 0) -> str:
    return data_url(image_bytes(kind[0], size, noise=True, seed=seed), kind[1])


CASES: dict[str, list[dict[str, Any]]] = {
    "one-png": [{"role": "user", "content": [text_part("What is in this picture?"),
                                             image_part(url_of(PNG, (64, 48)))]}],
    "png-jpeg-webp-in-one-message": [{"role": "user", "content": [
        text_part("Compare these three."),
        image_part(url_of(PNG, (40, 40))), image_part(url_of(JPEG, (320, 200), 1)),
        image_part(url_of(WEBP, (77, 91), 2)),
    ]}],
    "four-images-across-messages": [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [image_part(url_of(JPEG, (1, 1))), text_part("first two"),
                                     image_part(url_of(PNG, (640, 480), 3))]},
        {"role": "assistant", "content": "Two images: a dot and a photo."},
        {"role": "user", "content": [text_part("and now"), image_part(url_of(WEBP, (336, 336), 4)),
                                     image_part(url_of(PNG, (1024, 768), 5))]},
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_image_request_is_encoded_on_a_vision_gpu_and_handed_to_a_language_gpu(gw: Gateway, case: str) -> None:
    messages = CASES[case]
    n = sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url")
    backends = wait_all_healthy(gw)
    gpus = {b["id"]: b["gpu"] for b in backends}
    before = by_id(gw)
    metric_bytes = {v: metric_total(gw, "heterogate_embedding_bytes_total", backend=v) for v in VISION}
    encodes = {v: metric_total(gw, "heterogate_encode_seconds_count", backend=v) for v in VISION}
    handoffs = metric_total(gw, "heterogate_handoff_wait_seconds_count", backend=LANGUAGE)
    expected_text = text_tokens(gw, messages)

    r = post_chat(gw, messages)
    assert r.status_code == 200, r.text
    vision, language = r.headers["x-heterogate-vision-backend"], r.headers["x-heterogate-backend"]
    assert vision in VISION and language == LANGUAGE
    assert gpus[vision] == "RTX-4090" and gpus[language] == "H100" and gpus[vision] != gpus[language]
    assert r.json()["usage"]["prompt_tokens"] == expected_text + IMAGE_TOKENS * n

    # The bytes really went out of the chosen vision engine (engine-reported) and the gateway counted them.
    gw.wait_until(lambda: gw.backend(vision)["embedding_bytes_sent"] > before[vision]["embedding_bytes_sent"])
    after = by_id(gw)
    assert after[vision]["embedding_bytes_sent"] - before[vision]["embedding_bytes_sent"] == n * EMBEDDING_BYTES
    assert after[vision]["images_encoded"] - before[vision]["images_encoded"] == n
    assert metric_total(gw, "heterogate_embedding_bytes_total", backend=vision) - metric_bytes[vision] == (
        n * EMBEDDING_BYTES)
    assert metric_total(gw, "heterogate_encode_seconds_count", backend=vision) - encodes[vision] == 1
    other = next(v for v in VISION if v != vision)
    assert after[other]["embedding_bytes_sent"] == before[other]["embedding_bytes_sent"]
    assert metric_total(gw, "heterogate_embedding_bytes_total", backend=other) == metric_bytes[other]
    # The language engine waited for the hand-off before its first token.
    assert metric_total(gw, "heterogate_handoff_wait_seconds_count", backend=LANGUAGE) - handoffs == 1


def test_image_request_through_the_openai_client(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "Two pictures."},
        {"type": "image_url", "image_url": {"url": url_of(PNG, (128, 96), 7), "detail": "low"}},
        {"type": "image_url", "image_url": {"url": url_of(JPEG, (96, 128), 8)}},
    ]}]
    expected_text = text_tokens(gw, messages)
    resp = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=5)
    completion = resp.parse()
    assert resp.headers["x-heterogate-vision-backend"] in VISION
    assert resp.headers["x-heterogate-backend"] == LANGUAGE
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.prompt_tokens == expected_text + 2 * IMAGE_TOKENS


def test_streaming_image_request_reports_usage_with_image_tokens(gw: Gateway) -> None:
    messages = [{"role": "user", "content": [text_part("Stream about it."), image_part(url_of(WEBP, (50, 50), 9))]}]
    expected_text = text_tokens(gw, messages)
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gw.url}{CHAT}", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-heterogate-vision-backend"] in VISION
        payloads = list(sse_payloads(r.iter_lines()))
    assert payloads[-1] == "[DONE]"
    usage = [json.loads(p)["usage"] for p in payloads[:-1] if json.loads(p).get("usage")]
    assert usage and usage[-1]["prompt_tokens"] == expected_text + IMAGE_TOKENS


def test_text_only_requests_never_touch_the_vision_pool(gw: Gateway) -> None:
    """Even with the language backlog at or above τ: stealing is switched off (gateway.stealing.enabled)."""
    backends = wait_all_healthy(gw)
    assert all(b["steal"] and b["kv_total_bytes"] > 0 for b in backends if b["id"] in VISION)  # could steal
    before = vision_counters(gw)
    completed = gw.backend(LANGUAGE)["requests_completed"]
    encodes = {v: metric_total(gw, "heterogate_encode_seconds_count", backend=v) for v in VISION}
    n = 8

    def one(i: int) -> httpx.Response:
        rid = long_request_id(80, prefix=f"txt{i}")
        if i % 2:
            return httpx.post(f"{gw.url}/v1/completions", headers={"x-request-id": rid}, timeout=30,
                              json={"model": MODEL, "prompt": f"text only {i}", "max_tokens": 80})
        return post_chat(gw, [{"role": "user", "content": [text_part(f"text only {i}")]}], max_tokens=80,
                         request_id=rid)

    max_waiting = 0
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        while not all(f.done() for f in futures):
            max_waiting = max(max_waiting, gw.backend(LANGUAGE)["waiting"])
            time.sleep(0.02)
        responses = [f.result() for f in futures]
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-heterogate-backend"] == LANGUAGE
        assert "x-heterogate-vision-backend" not in r.headers
    assert max_waiting >= TAU, f"the language backlog never reached τ={TAU} (max {max_waiting})"
    gw.wait_until(lambda: gw.backend(LANGUAGE)["requests_completed"] >= completed + n)
    assert vision_counters(gw) == before
    for v in VISION:
        assert gw.backend(v)["vision_backlog"] == 0 and gw.backend(v)["in_flight"] == 0
        assert metric_total(gw, "heterogate_encode_seconds_count", backend=v) == encodes[v]
        assert metric_total(gw, "heterogate_stolen_requests_total", backend=v) == 0


def test_remote_image_on_loopback_is_fetched_when_private_addresses_are_allowed(gw: Gateway) -> None:
    with serving_images(image_bytes("PNG", (120, 80), noise=True)) as server:
        messages = [{"role": "user", "content": [text_part("fetch me"), image_part(server.url())]}]
        expected_text = text_tokens(gw, messages)
        r = post_chat(gw, messages)
        assert r.status_code == 200, r.text
        assert r.headers["x-heterogate-vision-backend"] in VISION
        assert r.json()["usage"]["prompt_tokens"] == expected_text + IMAGE_TOKENS
        assert server.hits == ["/cat.png"]

        # No redirects are followed (the target would be fetched unchecked), and a non-200 is a 400.
        for path, fragment in (("/redirect", "HTTP 302"), ("/missing.png", "HTTP 404")):
            bad = [{"role": "user", "content": [text_part("x"), text_part("y"), image_part(server.url(path))]}]
            r = post_chat(gw, bad)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages.0.content.2" and fragment in err["message"], err
        assert server.hits == ["/cat.png", "/redirect", "/missing.png"]


def test_a_reused_request_id_does_not_pick_up_a_stale_embedding(gw: Gateway) -> None:
    """The hand-off must not be keyed by the client's x-request-id alone.

    The gateway honours x-request-id and passes it to the engines as the hand-off key. An embedding
    already waiting at the language engine under that id (a late delivery for an earlier request that
    used the same id; planted here over gRPC) is then taken by the new request, whose Generate starts
    at once on someone else's image instead of waiting for its own (≥ the 25 ms aligned-batch wait). Each
    request's image is one no encoder holds: a cached one is answered without that wait.
    """

    def handoff_wait(request_id: str, seed: int) -> float:
        count0 = metric_total(gw, "heterogate_handoff_wait_seconds_count", backend=LANGUAGE)
        sum0 = metric_total(gw, "heterogate_handoff_wait_seconds_sum", backend=LANGUAGE)
        messages = [{"role": "user", "content": [text_part("What is in this picture?"),
                                                 image_part(url_of(PNG, (64, 48), seed=seed))]}]
        r = post_chat(gw, messages, request_id=request_id)
        assert r.status_code == 200, r.text
        assert metric_total(gw, "heterogate_handoff_wait_seconds_count", backend=LANGUAGE) - count0 == 1
        return metric_total(gw, "heterogate_handoff_wait_seconds_sum", backend=LANGUAGE) - sum0

    # Control: a fresh id waits for its own embedding (encode starts after the 25 ms aligned-batch wait).
    fresh = handoff_wait("fresh-request-id-1", 9_001)
    assert fresh >= 0.01, fresh
    rid = "reused-request-id-1"
    with grpc.insecure_channel(gw.backend(LANGUAGE)["address"], options=GRPC_OPTIONS) as channel:
        engine_pb2_grpc.EngineStub(channel).DeliverEmbedding(engine_pb2.Embedding(
            request_id=rid, image_index=0, tokens=IMAGE_TOKENS, hidden=4096, dtype="float16",
            data=bytes(EMBEDDING_BYTES)), timeout=10)
    waited = handoff_wait(rid, 9_002)
    assert waited >= 0.01, (
        f"the language engine waited {waited * 1000:.2f} ms for this request's image (a fresh id: "
        f"{fresh * 1000:.1f} ms): it used a stale embedding delivered under the same request id")


# --- vision-engine failures (these kill / stop engines: keep them last) --------------------------


def probe_vision(gw: Gateway) -> str:
    """Which vision backend the next image request goes to (encode_cost: equal idle GPUs → the first)."""
    r = post_chat(gw, CASES["one-png"], max_tokens=1)
    assert r.status_code == 200, r.text
    return r.headers["x-heterogate-vision-backend"]


def wait_restarted(gw: Gateway, backend_id: str, old_pid: int) -> None:
    gw.wait_until(lambda: (b := gw.backend(backend_id))["healthy"] and b["pid"] not in (None, old_pid), timeout=30)


def test_killed_vision_engine_is_re_encoded_on_the_other(gw: Gateway) -> None:
    wait_all_healthy(gw)
    victim = probe_vision(gw)
    other = next(v for v in VISION if v != victim)
    before = gw.backend(other)["images_encoded"]
    retries = metric_total(gw, "heterogate_dispatch_retries_total", backend=victim)
    pid = engine_pid(gw, victim)
    os.kill(pid, signal.SIGKILL)
    try:
        r = post_chat(gw, CASES["one-png"])   # before its heartbeats lapse: still a candidate
        assert r.status_code == 200, f"{r.text}\n{gw.log_tail()}"
        assert r.headers["x-heterogate-vision-backend"] == other, gw.log_tail()
        # Usually the victim is tried, its broken stream fails the encode and the retry goes to the other;
        # on a loaded machine the supervisor can see the exit first and route straight to the other.
        after = metric_total(gw, "heterogate_dispatch_retries_total", backend=victim)
        assert after in (retries, retries + 1), gw.log_tail()
        gw.wait_until(lambda: gw.backend(other)["images_encoded"] >= before + 1)
    finally:
        wait_restarted(gw, victim, pid)


def test_stopped_vision_engine_is_re_encoded_on_the_other(gw: Gateway) -> None:
    """A hung (SIGSTOPped) vision engine times out after handoff_timeout_s; the other one re-encodes.

    The language engine must still be waiting for the embedding when the re-encode delivers it.
    """
    wait_all_healthy(gw)
    victim = probe_vision(gw)
    other = next(v for v in VISION if v != victim)
    retries = metric_total(gw, "heterogate_dispatch_retries_total", backend=victim)
    with sigstopped(engine_pid(gw, victim)):
        r = post_chat(gw, CASES["one-png"])
    try:
        assert r.status_code == 200, r.text
        assert r.headers["x-heterogate-vision-backend"] == other
        assert r.headers["x-heterogate-backend"] == LANGUAGE
        assert metric_total(gw, "heterogate_dispatch_retries_total", backend=victim) == retries + 1
    finally:
        wait_all_healthy(gw)


def test_no_healthy_vision_backend_is_a_clean_503(gw: Gateway) -> None:
    """Every vision engine silent past the heartbeat limit and the fail-open window: image requests get 503,
    text requests still work."""
    wait_all_healthy(gw)
    pids = [engine_pid(gw, v) for v in VISION]
    with sigstopped(pids[0]), sigstopped(pids[1]):
        gw.wait_until(lambda: not any(gw.backend(v)["healthy"] for v in VISION), timeout=10)
        time.sleep(0.8)   # unhealthy 2 s after the last heartbeat; past the 2.5 s window now
        r = post_chat(gw, CASES["one-png"])
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_backend_available", r.text
        text = post_chat(gw, [{"role": "user", "content": "text still works"}])
        assert text.status_code == 200, text.text
    wait_all_healthy(gw)


def test_vision_failures_do_not_open_the_language_breaker(gw: Gateway) -> None:
    """Image requests that fail because the vision pool hangs must not take the healthy language GPU out.

    The gateway's breaker opens after `failure_threshold` (3) consecutive failures of a backend; here
    the failures are the vision engines', so the language backend's breaker must stay closed.
    """
    wait_all_healthy(gw)
    assert gw.backend(LANGUAGE)["breaker"] == "closed"
    pids = [engine_pid(gw, v) for v in VISION]
    with sigstopped(pids[0]), sigstopped(pids[1]):
        with ThreadPoolExecutor(3) as pool:
            failed = list(pool.map(lambda _: post_chat(gw, CASES["one-png"]), range(3)))
        assert all(r.status_code in (502, 504) for r in failed), [r.text for r in failed]
    try:
        assert gw.backend(LANGUAGE)["breaker"] == "closed", "vision failures were blamed on the language backend"
        r = post_chat(gw, [{"role": "user", "content": "text still works"}])
        assert r.status_code == 200, r.text
    finally:
        wait_all_healthy(gw)
