"""Image requests queued behind a burst on a slow encoder.

    l4-0    language  L4        idle but for short text requests and, one at a time, the images' prefills
    v-0     vision    RTX-4090  the only encoder: ~0.4 s an image (time_scale 400), one at a time

While they wait for their encode, their language dispatches wait on l4-0 for the embeddings, and the engine
can start none of their prefills before they come. Counted as prefill backlog from their dispatch, they
read as seconds of predicted first-token time on the idle l4-0: the overload gate (on by default) held
text requests and refused them with 429 after its 1 s wait, and each image request's encode wait was
learned as its prefill (p̂ several times the prior).

With a 1 s hand-off limit the later ones of a burst cannot be encoded in time. Each such request gets a
504 that names the limit (it was a 502 "failed or could not be reached"), and the encoder, heartbeating
and working through its queue, keeps its breaker closed: image requests sent after the burst are served
(they got 503 "circuit breaker open" while the encoder sat idle).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import data_url, image_bytes, image_part, run_gateway, text_part, wait_all_healthy, write_config

MODEL = "llava-1.5-7b"

pytestmark = pytest.mark.timeout(180)


def ask(url: str, seed: int, images: int) -> httpx.Response:
    pictures = [image_part(data_url(image_bytes("PNG", (48, 48), noise=True, seed=seed * 10 + k)))
                for k in range(images)]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        *pictures, text_part(f"what is in these, {seed}?")]}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def slow_encoder(tmp: Path, **gateway: Any) -> Path:
    return write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20, "stealing": {"enabled": False},
                    **gateway},
        "backends": [
            {"id": "l4-0", "role": "language", "gpu": "L4", "launch": {}},
            {"id": "v-0", "role": "vision", "gpu": "RTX-4090",
             "launch": {"time_scale": 400, "vision_batch": 1, "vision_batch_timeout_ms": 0.01}},
        ],
    })


def test_text_requests_are_served_while_image_requests_wait_for_a_slow_encoder(tmp_path: Path) -> None:
    with run_gateway(slow_encoder(tmp_path, handoff_timeout_s=60)) as gw:
        wait_all_healthy(gw)
        prior = gw.backend("l4-0")["learned_speed"]["prefill_prior_s_per_token"]
        text: list[int] = []
        done = threading.Event()

        def trickle() -> None:
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
            while not done.is_set():
                text.append(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60).status_code)
                time.sleep(0.2)

        talker = threading.Thread(target=trickle, daemon=True)
        talker.start()
        with ThreadPoolExecutor(6) as pool:   # ~7 s of encoding queued at once
            images = [r.status_code for r in pool.map(lambda k: ask(gw.url, k, 3), range(6))]
        done.set()
        talker.join(timeout=60)
        assert images == [200] * 6, images
        assert len(text) >= 10 and set(text) == {200}, text   # 429 "overloaded" for ~5 s before
        speed = gw.backend("l4-0")["learned_speed"]
        # each image prefill timed from its delivery: near the prior (it was learned at 3-4x it)
        assert speed["prefill_samples"] > 0 and speed["prefill_s_per_token"] < 2 * prior, (speed, prior)


def test_an_encode_queued_past_the_hand_off_limit_is_a_504_and_opens_no_breaker(tmp_path: Path) -> None:
    config = slow_encoder(tmp_path, handoff_timeout_s=1.0, overload={"enabled": False},
                          breaker={"failure_threshold": 2})
    with run_gateway(config) as gw:
        wait_all_healthy(gw)
        with ThreadPoolExecutor(6) as pool:   # ~7 s of encoding at once
            burst = list(pool.map(lambda k: ask(gw.url, k, 3), range(6)))
        timed_out = [r for r in burst if r.status_code != 200]
        assert timed_out, [r.status_code for r in burst]
        for r in timed_out:
            assert r.status_code == 504, r.text
            error = r.json()["error"]
            assert error["code"] == "backend_timeout", error
            assert "encode did not finish within 1 s (gateway.handoff_timeout_s)" in error["message"], error
        assert gw.backend("v-0")["breaker"] == "closed"
        gw.wait_until(lambda: gw.backend("v-0")["vision_backlog"] == 0, timeout=30)
        after = [ask(gw.url, 100 + k, 1) for k in range(3)]
        assert [r.status_code for r in after] == [200] * 3, [r.text for r in after]
