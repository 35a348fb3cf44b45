"""Image requests when no vision backend can encode: a `both` engine beside them takes them.

    h100-0   language  H100     needs an encoder for its images (the router prefers it: the faster GPU)
    l40s-b   both      L40S     encodes its own images
    v-0      vision    RTX-4090 the only encoder

With the encoder drained (no candidate left in the vision pool), an image request the router sends to
h100-0 cannot be encoded for it; it goes to l40s-b, which encodes its own images, instead of ending in
a 503. Text requests still go where the router likes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from testkit.harness import data_url, image_bytes, image_part, run_gateway, text_part, wait_all_healthy, write_config

MODEL = "llava-1.5-7b"

pytestmark = pytest.mark.timeout(120)


def test_image_requests_go_to_a_both_engine_when_no_encoder_is_left(tmp_path: Path) -> None:
    config = write_config(tmp_path, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20, "stealing": {"enabled": False}},
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {}},
            {"id": "l40s-b", "role": "both", "gpu": "L40S", "launch": {}},
            {"id": "v-0", "role": "vision", "gpu": "RTX-4090", "launch": {}},
        ],
    })
    with run_gateway(config) as gw:
        wait_all_healthy(gw)
        drained = httpx.post(f"{gw.url}/admin/backends/v-0/drain", timeout=30)
        assert drained.status_code == 202, drained.text
        gw.wait_until(lambda: next(b for b in gw.backends() if b["id"] == "v-0").get("draining"), timeout=20)
        served = []
        for k in range(6):
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                image_part(data_url(image_bytes(seed=k))), text_part(f"what is this, {k}?")]}]}
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            served.append(r.headers["x-heterogate-backend"])
        text = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
        assert text.status_code == 200, text.text
        assert set(served) == {"l40s-b"}, served
        log = gw.log_path.read_text()
        assert "encoders_unavailable" in log   # the router did send some to h100-0, which could not take them
