"""The torch vision encoder: LLaVA-1.5 preprocessing, the vision tower and the projector, nothing else.

Preprocessing is Hugging Face's LLaVA image processor as LLaVA-1.5 uses it: pad to a square with the mean
colour, resize to the tower's image size (336 px for LLaVA-1.5-7B; the tiny model's own size), CLIP
normalisation. The tower's penultimate layer without its CLS token goes through the projector: one
`[tokens, hidden]` embedding per image in the model's dtype, sent as raw bytes (bf16 as its 16-bit words).
A batch runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from transformers import LlavaImageProcessorPil

from backends.executors import EncodedImage
from backends.torch_models import LoadedModel
from heterogate.wire import engine_pb2


@dataclass(slots=True)
class TensorEmbedding:
    tokens: int
    hidden: int
    dtype: str
    features: torch.Tensor

    def payload(self) -> bytes:
        return self.features.contiguous().view(torch.uint8).numpy().tobytes()


def image_processor(loaded: LoadedModel) -> LlavaImageProcessorPil:
    vision: Any = loaded.model.config.vision_config
    side = int(vision.image_size)
    return LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                  do_pad=True)


class TorchEncoder:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.processor = image_processor(loaded)
        config = loaded.model.config
        text: Any = config.text_config
        self.hidden = int(text.hidden_size)
        self._layer, self._strategy = config.vision_feature_layer, config.vision_feature_select_strategy

    async def encode_batch(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        return await asyncio.to_thread(self.encode_now, images)

    def features(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """Blocking: the projected features of each image, [tokens, hidden] in the model's dtype (on the CPU)."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = self.loaded.model.model.get_image_features(
                pixel_values=pixels.to(self.loaded.device, self.loaded.dtype), vision_feature_layer=self._layer,
                vision_feature_select_strategy=self._strategy,
            )
        return [f.to("cpu") for f in out.pooler_output]

    def encode_now(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        start = time.monotonic()
        pil = [Image.open(io.BytesIO(img.data)).convert("RGB") for img in images]
        feats = self.features(pil)
        dtype = self.loaded.dtype_name
        encoded: list[EncodedImage] = [TensorEmbedding(f.shape[0], f.shape[1], dtype, f) for f in feats]
        return encoded, time.monotonic() - start
