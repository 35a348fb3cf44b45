"""The default demo cluster serves a mix of text-only and image requests (30% with images), no errors."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from testkit.harness import Gateway, data_url, image_bytes

MODEL = "llava-1.5-7b"
TOTAL = 100


def body(i: int, image: str) -> dict[str, object]:
    text = {"type": "text", "text": "Describe this image in detail. " * (1 + i % 5)}
    content: list[dict[str, object]] | str = [text, {"type": "image_url", "image_url": {"url": image}}]
    if i % 10 >= 3:   # 70% text only
        content = "Tell me about GPUs. " * (1 + i % 20)
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16 + i % 48,
            "stream": i % 4 == 0}


def test_thirty_percent_image_mix(demo_gateway: Gateway) -> None:
    image = data_url(image_bytes("PNG", (640, 480)))
    outcomes: Counter[str] = Counter()
    pairs: Counter[tuple[str, str]] = Counter()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        resp = await client.post("/v1/chat/completions", json=body(i, image))
        ok = resp.status_code == 200 and '"error"' not in resp.text
        outcomes["ok" if ok else f"error {resp.status_code}"] += 1
        if "x-heterogate-vision-backend" in resp.headers:
            pairs[(resp.headers["x-heterogate-vision-backend"], resp.headers["x-heterogate-backend"])] += 1

    async def run() -> None:
        async with httpx.AsyncClient(base_url=demo_gateway.url, timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(TOTAL)))

    asyncio.run(run())
    print(f"\n30% image mix on the demo: {dict(outcomes)}; image requests by (vision, language): {dict(pairs)}")
    assert outcomes == Counter({"ok": TOTAL})
    assert sum(pairs.values()) == 30
