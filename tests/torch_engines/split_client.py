"""Client side of the exactness tests: images, messages, and greedy requests through a gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from testkit.harness import Gateway, data_url, image_bytes, image_part, text_part


def launch(model_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"executor": "torch", "model_path": str(model_dir), "max_batch": 8, "max_model_len": 256,
            "vision_batch_timeout_ms": 5, **extra}


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)


def images(n: int, seed: int = 0) -> list[bytes]:
    """Noise PNGs of assorted sizes (Qwen2.5-VL: different token counts)."""
    sizes = [(40, 30), (64, 64), (23, 57), (100, 48)]
    return [image_bytes("PNG", sizes[(seed + i) % len(sizes)], noise=True, seed=seed + i) for i in range(n)]


def user_message(text: str, imgs: list[bytes]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*(image_part(data_url(b)) for b in imgs), text_part(text)]}]


def ask_on(gw: Gateway, model: str, text: str, imgs: list[bytes], max_tokens: int) -> (
    tuple[tuple[str, int, int], str]
):
    """(text, prompt tokens, completion tokens) of a greedy request, and the language backend that ran it."""
    raw = client(gw).chat.completions.with_raw_response.create(
        model=model, messages=user_message(text, imgs), max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
    )
    out = raw.parse()
    assert out.usage is not None
    answer = (out.choices[0].message.content or "", out.usage.prompt_tokens, out.usage.completion_tokens)
    return answer, raw.headers["x-heterogate-backend"]
