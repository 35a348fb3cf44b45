"""Image embeddings as vLLM `image_embeds` content parts, for `kind: openai` language backends.

vLLM (started with `--enable-mm-embeds`) takes a precomputed image embedding in place of an image:
`{"type": "image_embeds", "image_embeds": <base64 of torch.save(tensor (tokens, hidden))>}`; Qwen2/2.5-VL
also need the patch grid: `"image_embeds": {"image_embeds": ..., "image_grid_thw": <base64 tensor [t, h, w]>}`.
The gateway checks every embedding against the model catalog before sending (token count, hidden size,
dtype, byte length, and for Qwen the grid that the token count implies): a wrong shape is caught here
with a clear error instead of as an opaque failure inside the engine.

torch is needed only for this path (`pip install -e ".[vllm-embeds]"`); it is imported on first use.
"""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Sequence
from typing import Any

from common.catalog import DTYPE_BYTES, ModelProfile
from common.wire import engine_pb2
from gateway.requests.errors import BackendFailure
from gateway.requests.images import ImageInput

TORCH_DTYPES = ("float16", "bfloat16", "float32")


def check_embedding(model: ModelProfile, image: ImageInput, emb: engine_pb2.Embedding, index: int) -> None:
    """The embedding the vision backend returned must be exactly what the language model expects."""
    problems = []
    if emb.tokens != image.tokens:
        problems.append(f"{emb.tokens} tokens, expected {image.tokens}")
    if emb.hidden != model.hidden:
        problems.append(f"hidden size {emb.hidden}, expected {model.hidden}")
    if emb.dtype != model.dtype or emb.dtype not in TORCH_DTYPES:
        problems.append(f"dtype {emb.dtype!r}, expected {model.dtype!r}")
    elif len(emb.data) != emb.tokens * emb.hidden * DTYPE_BYTES[emb.dtype]:
        problems.append(f"{len(emb.data)} bytes for {emb.tokens}×{emb.hidden} {emb.dtype}")
    grid = model.image_grid_thw(image.width, image.height)
    if grid is not None and model.vision is not None:
        merge = (model.vision.pixels_per_token_side // model.vision.patch_size) ** 2
        if grid[0] * grid[1] * grid[2] != emb.tokens * merge:
            problems.append(f"grid {grid} implies {grid[0] * grid[1] * grid[2] // merge} tokens")
    if problems:
        raise BackendFailure(f"embedding of image {index} does not fit model {model.name}: {'; '.join(problems)}",
                             backend_id="", retryable=False)


def _b64_tensor(tensor: Any) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def embeds_part(model: ModelProfile, image: ImageInput, emb: engine_pb2.Embedding) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, emb.dtype)
    tensor = torch.frombuffer(bytearray(emb.data), dtype=dtype).view(emb.tokens, emb.hidden)
    grid = model.image_grid_thw(image.width, image.height)
    if grid is None:
        return {"type": "image_embeds", "image_embeds": _b64_tensor(tensor)}
    return {"type": "image_embeds", "image_embeds": {
        "image_embeds": _b64_tensor(tensor),
        "image_grid_thw": _b64_tensor(torch.tensor(grid, dtype=torch.int64)),
    }}


def with_image_embeds(
    body: dict[str, Any], model: ModelProfile, images: Sequence[ImageInput], embeddings: Sequence[engine_pb2.Embedding]
) -> dict[str, Any]:
    """A copy of the chat body whose image_url parts, in order, are replaced by image_embeds parts.

    CPU-bound (tensor serialisation and base64 of megabytes): run it off the event loop.
    """
    if len(embeddings) != len(images):
        raise BackendFailure(f"{len(embeddings)} embeddings for {len(images)} images", backend_id="",
                             retryable=False)
    ordered = sorted(embeddings, key=lambda e: e.image_index)
    for i, (image, emb) in enumerate(zip(images, ordered, strict=True)):
        check_embedding(model, image, emb, i)
    parts = iter([embeds_part(model, image, emb) for image, emb in zip(images, ordered, strict=True)])
    out = copy.copy(body)
    out["messages"] = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": [next(parts) if p.get("type") == "image_url" else p for p in content]}
        out["messages"].append(message)
    return out
