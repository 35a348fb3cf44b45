"""vLLM as the language side of the modality split: real processes on 127.0.0.1.

    rtx4090-0   vision   managed engine (encodes, returns the embedding to the gateway)
    ext-vllm    openai   fake vLLM with --embeds-only (image_url parts refused, image_embeds decoded
                         with torch.load as vLLM does), scraped by the gateway, `image_embeds: true`

An image request must be encoded on the RTX 4090 and reach the upstream as one (576, 4096) float16
tensor per image; text-only requests go straight to the upstream.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import ROOT, Gateway, data_url, free_port, image_bytes, run_gateway, sse_payloads, write_config

MODEL = "llava-1.5-7b"
VISION, UPSTREAM = "rtx4090-0", "ext-vllm"
CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    tmp: Path = tmp_path_factory.mktemp("vllm-embeds")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = write_config(tmp, {
        "model": MODEL,
        # the fake upstream decodes the embeddings but runs no model: simulated ones are fine here; it
        # answers no scrape while it decodes (torch.load of ~5 MB a request, seconds on a loaded 2-core
        # host, where 2 s of silence marked it down under the request): 6 s
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 60,
                    "stealing": {"enabled": False}, "simulated_embeddings": True},
        "backends": [
            {"id": VISION, "role": "vision", "gpu": "RTX-4090", "launch": {"time_scale": 0.2}},
            {"id": UPSTREAM, "kind": "openai", "gpu": "A100-80GB", "address": url, "image_embeds": True,
             "scrape": {"engine": "vllm", "interval_ms": 100}},
        ],
    })
    upstream = subprocess.Popen([sys.executable, "-m", "tests.fake_openai_server", "--port", str(port),
                                 "--engine", "vllm", "--embeds-only"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with run_gateway(config) as gw:
            yield gw, url
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)


def upstream_embeds(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/stats", timeout=5).json()["checked"])


def image_message(n_images: int, seed: int = 0) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe these images."}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(64, 48), noise=True,
                                                                              seed=seed + i))}}
              for i in range(n_images)]
    return [{"role": "user", "content": parts}]


def test_images_reach_vllm_as_embeddings_of_the_right_shape(cluster: tuple[Gateway, str]) -> None:
    gw, url = cluster
    before = len(upstream_embeds(url))
    r = httpx.post(f"{gw.url}{CHAT}", json={"model": MODEL, "messages": image_message(2), "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-heterogate-backend"] == UPSTREAM
    assert r.headers["x-heterogate-vision-backend"] == VISION
    got = upstream_embeds(url)[before:]
    assert got == [{"shape": [576, 4096], "dtype": "float16", "finite": True, "grid": None}] * 2


def test_streamed_image_request_and_text_only_request(cluster: tuple[Gateway, str]) -> None:
    gw, url = cluster
    before = len(upstream_embeds(url))
    body = {"model": MODEL, "messages": image_message(1, seed=7), "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{gw.url}{CHAT}", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-heterogate-vision-backend"] == VISION
        payloads = list(sse_payloads(r.iter_lines()))
    assert payloads[-1] == "[DONE]" and not any('"error"' in p for p in payloads)
    assert len(upstream_embeds(url)) == before + 1
    text = httpx.post(f"{gw.url}{CHAT}", json={"model": MODEL, "max_tokens": 3,
                                                "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert text.status_code == 200 and "x-heterogate-vision-backend" not in text.headers
    assert len(upstream_embeds(url)) == before + 1
