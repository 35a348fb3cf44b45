"""Image affinity end to end: a repeated image goes back to the encoder that holds its embedding.

    h100-0      language  H100
    rtx4090-a   vision    RTX-4090  embedding cache of the last 256 images (the engines' default)
    rtx4090-b   vision    RTX-4090

Two equal encoders: without cache awareness `encode_cost` sends every image request to the first idle
one (a tie). With it, the gateway remembers which encoder got which image (by content hash) and
prices a predicted hit as no encode there, so a repeated image goes to the encoder that holds it,
which reports the hit, unless that encoder's queue costs more than encoding the image elsewhere.
The vision engines run at time_scale 250 (an encode of 6 images takes ~1.5 s) so that a request's
encode is still in flight when the next request is routed (milliseconds later: the test waits on the
gateway's own view of each encoder's backlog, never on a clock). The routing decisions compare image
tokens, so the clock's scale does not change them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import (
    Gateway,
    data_url,
    engine_pid,
    image_bytes,
    image_part,
    run_gateway,
    text_part,
    wait_all_healthy,
    write_config,
)

MODEL = "llava-1.5-7b"
VISION_A, VISION_B = "rtx4090-a", "rtx4090-b"

pytestmark = pytest.mark.timeout(120)


def start(tmp: Path, b_args: list[str]) -> Iterator[Gateway]:
    """The cluster above; `b_args`: the second encoder's extra engine arguments."""
    vision_launch = {"time_scale": 250, "vision_batch_timeout_ms": 0.01}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "stealing": {"enabled": False},
                    "routing": {"vision_policy": "encode_cost"}},
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {}},
            {"id": VISION_A, "role": "vision", "gpu": "RTX-4090", "launch": vision_launch},
            {"id": VISION_B, "role": "vision", "gpu": "RTX-4090", "launch": {**vision_launch, "extra_args": b_args}},
        ],
    })
    with run_gateway(config) as g:
        yield g


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from start(tmp_path_factory.mktemp("image-affinity"), [])


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The second encoder keeps one embedding (`--embedding-cache-images 1`), the gateway's index 256."""
    yield from start(tmp_path_factory.mktemp("image-affinity-small"), ["--embedding-cache-images", "1"])


def image(seed: int) -> dict[str, Any]:
    return image_part(data_url(image_bytes("PNG", (48, 48), noise=True, seed=seed)))


def ask(gw: Gateway, *images: dict[str, Any]) -> str:
    """One chat request with these images; returns the vision backend that encoded them."""
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [text_part("What is in these pictures?"), *images]}]}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, f"{r.text}\n{gw.log_tail()}"
    return r.headers["x-heterogate-vision-backend"]


def busy(gw: Gateway, pool: ThreadPoolExecutor, encoder: str, *images: dict[str, Any]) -> Future[str]:
    """Send a request with these images in the background; return once the gateway counts its encode on
    `encoder` (the request's vision lease: image tokens in flight there)."""
    pending = pool.submit(ask, gw, *images)
    gw.wait_until(lambda: pending.done() or gw.backend(encoder)["vision_backlog"] > 0, timeout=30)
    assert not pending.done(), "the background encode ended before the next request was routed"
    return pending


def test_a_repeated_image_goes_to_the_encoder_that_holds_it_unless_it_is_overloaded(gw: Gateway) -> None:
    wait_all_healthy(gw)
    picture = image(1)
    with ThreadPoolExecutor(2) as pool:
        # Six new images on the first encoder (both idle: a tie, the first); meanwhile the picture goes
        # to the second, the first being busy.
        first = busy(gw, pool, VISION_A, *(image(100 + k) for k in range(6)))
        assert gw.backend(VISION_A)["encoding_image_tokens"] == 6 * 576   # the encode under way, as admin shows it
        assert ask(gw, picture) == VISION_B
        assert first.result() == VISION_A
        assert gw.backend(VISION_A)["encoding_image_tokens"] == 0
        # Both idle again: the picture goes back where its embedding is (a tie would pick the first)...
        hits = gw.backend(VISION_B)["embedding_cache_hits"]
        assert ask(gw, picture) == VISION_B
        # ... and that engine found it in its cache instead of encoding it (its heartbeats say so)
        gw.wait_until(lambda: gw.backend(VISION_B)["embedding_cache_hits"] >= hits + 1)
        # The second encoder busy with five new images (it got them with the picture, which it holds):
        # the picture alone now costs less to encode again on the idle first encoder than to wait.
        second = busy(gw, pool, VISION_B, picture, *(image(200 + k) for k in range(5)))
        assert ask(gw, picture) == VISION_A
        assert second.result() == VISION_B


def test_an_encoder_that_restarted_is_not_credited_with_the_images_it_held(gw: Gateway) -> None:
    """A restarted vision engine has an empty embedding cache: once its new process reports, the gateway
    forgets which images it held, and a repeated image is a miss there like anywhere (a tie: the first)."""
    wait_all_healthy(gw)
    picture = image(2)
    with ThreadPoolExecutor(1) as pool:
        first = busy(gw, pool, VISION_A, *(image(300 + k) for k in range(6)))
        assert ask(gw, picture) == VISION_B   # the first encoder busy: the picture goes to the second
        assert first.result() == VISION_A
    assert ask(gw, picture) == VISION_B       # both idle: back where its embedding is
    old = engine_pid(gw, VISION_B)
    os.kill(old, signal.SIGKILL)
    gw.wait_until(lambda: gw.backend(VISION_B)["healthy"] and gw.backend(VISION_B)["pid"] not in (None, old),
                  timeout=60)
    assert ask(gw, picture) == VISION_A       # no hit predicted on the restarted one: a tie, the first


def test_an_encoder_with_a_smaller_cache_is_credited_with_only_what_it_keeps(small: Gateway) -> None:
    """The engine reports the size of its embedding cache; the gateway's index keeps no more than that
    for it, so an image its engine has since dropped is no longer sent back there as a hit."""
    wait_all_healthy(small)
    assert small.backend(VISION_B)["embedding_cache_images"] == 1
    assert small.backend(VISION_A)["embedding_cache_images"] == 256
    picture, other = image(3), image(4)
    with ThreadPoolExecutor(1) as pool:
        for k, sent in enumerate((picture, other)):   # each while the first encoder is busy: to the second
            first = busy(small, pool, VISION_A, *(image(400 + 10 * k + j) for j in range(6)))
            assert ask(small, sent) == VISION_B
            assert first.result() == VISION_A
    # The second engine keeps only `other` now: the picture is a miss everywhere, a tie, the first.
    # (With the index's 256 a hit was predicted there, and the engine encoded it again.)
    assert ask(small, picture) == VISION_A
