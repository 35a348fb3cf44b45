"""vLLM image_embeds content parts: what vLLM's torch.load gets back, and shape checks before sending."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch

from common.catalog import load_catalog
from common.wire import engine_pb2
from gateway.clients.image_embeds import with_image_embeds
from gateway.requests.errors import BackendFailure
from gateway.requests.images import ImageInput

CATALOG = load_catalog()
LLAVA, QWEN = CATALOG.model("llava-1.5-7b"), CATALOG.model("qwen2.5-vl-7b")


def image(model: Any, width: int, height: int) -> ImageInput:
    return ImageInput(b"png", width, height, "PNG", model.image_tokens(width, height))


def embedding(model: Any, tokens: int, index: int = 0, *, hidden: int | None = None) -> engine_pb2.Embedding:
    hidden = hidden or model.hidden
    values = np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden) % 7
    data = torch.from_numpy(values).to(getattr(torch, model.dtype)).view(torch.uint16).numpy().tobytes()
    return engine_pb2.Embedding(request_id="k", image_index=index, tokens=tokens, hidden=hidden,
                                dtype=model.dtype, data=data)


def load(b64: str) -> torch.Tensor:
    tensor = torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def body(n_images: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "compare"}]
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}} for i in range(n_images)]
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]}


def test_llava_parts_replace_images_in_order_and_round_trip() -> None:
    images = [image(LLAVA, 640, 480), image(LLAVA, 32, 32)]
    embs = [embedding(LLAVA, 576, 1), embedding(LLAVA, 576, 0)]   # delivered out of order
    original = body(2)
    out = with_image_embeds(original, LLAVA, images, embs)
    assert original["messages"][1]["content"][1]["type"] == "image_url"   # the client's body is untouched
    system, user = out["messages"]
    assert system == {"role": "system", "content": "be brief"}
    assert [p["type"] for p in user["content"]] == ["text", "image_embeds", "image_embeds"]
    first = load(user["content"][1]["image_embeds"])
    assert first.shape == (576, 4096) and first.dtype == torch.float16
    expected = torch.frombuffer(bytearray(embs[1].data), dtype=torch.float16).view(576, 4096)
    assert torch.equal(first, expected)   # image 0's part carries the embedding with image_index 0


def test_qwen_parts_carry_the_patch_grid() -> None:
    img = image(QWEN, 1024, 768)   # smart_resize → 1036 × 756 px → 37 × 27 tokens = 999
    assert img.tokens == 999
    out = with_image_embeds(body(1), QWEN, [img], [embedding(QWEN, 999)])
    part = out["messages"][1]["content"][1]["image_embeds"]
    grid = load(part["image_grid_thw"])
    assert grid.tolist() == [1, 54, 74]   # patch rows/columns of 14 px; 2 × 2 patches merge into one token
    tensor = load(part["image_embeds"])
    assert tensor.shape == (999, 3584) and tensor.dtype == torch.bfloat16


@pytest.mark.parametrize(("emb", "message"), [
    (lambda: embedding(LLAVA, 575), "575 tokens, expected 576"),
    (lambda: embedding(LLAVA, 576, hidden=4095), "hidden size 4095, expected 4096"),
    (lambda: engine_pb2.Embedding(tokens=576, hidden=4096, dtype="float16", data=b"\0" * 10), "10 bytes"),
    (lambda: engine_pb2.Embedding(tokens=576, hidden=4096, dtype="fp8", data=b""), "dtype 'fp8'"),
])
def test_wrong_shapes_are_refused_before_sending(emb: Any, message: str) -> None:
    with pytest.raises(BackendFailure, match=message) as info:
        with_image_embeds(body(1), LLAVA, [image(LLAVA, 64, 64)], [emb()])
    assert not info.value.retryable


def test_embedding_count_must_match_images() -> None:
    with pytest.raises(BackendFailure, match="1 embeddings for 2 images"):
        with_image_embeds(body(2), LLAVA, [image(LLAVA, 64, 64)] * 2, [embedding(LLAVA, 576)])
