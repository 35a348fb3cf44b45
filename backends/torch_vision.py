"""The torch vision encoder: the model's preprocessing, the vision tower and the projector, nothing else.

LLaVA-1.5: Hugging Face's LLaVA image processor as LLaVA-1.5 uses it: pad to a square with the mean colour,
resize to the tower's image size (336 px for LLaVA-1.5-7B; the tiny model's own size), CLIP normalisation;
the tower's penultimate layer without its CLS token goes through the projector.
Qwen2.5-VL: its image processor resizes each image within the catalog's [min_pixels, max_pixels] to
multiples of 28 px and cuts it into patches with a `grid_thw`; the tower merges 2x2 patches per token.
Either way: one `[tokens, hidden]` embedding per image in the model's dtype, sent as raw bytes (bf16 as its
16-bit words). A batch runs in a worker thread so the event loop keeps serving.
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
from transformers import LlavaImageProcessorPil, Qwen2VLImageProcessorPil

from backends.executors import EncodedImage, InvalidInput
from backends.torch_models import LoadedModel
from common.catalog import ModelProfile
from common.wire import engine_pb2


@dataclass(slots=True)
class TensorEmbedding:
    tokens: int
    hidden: int
    dtype: str
    features: torch.Tensor

    def payload(self) -> bytes:
        return self.features.contiguous().view(torch.uint8).numpy().tobytes()


def image_processor(loaded: LoadedModel, profile: ModelProfile) -> Any:
    vision: Any = loaded.model.config.vision_config
    if loaded.family == "qwen2_5_vl":
        assert profile.vision is not None
        return Qwen2VLImageProcessorPil(min_pixels=profile.vision.min_pixels, max_pixels=profile.vision.max_pixels,
                                        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                        temporal_patch_size=vision.temporal_patch_size)
    side = int(vision.image_size)
    return LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                  do_pad=True)


class TorchEncoder:
    def __init__(self, loaded: LoadedModel, profile: ModelProfile) -> None:
        self.loaded = loaded
        self.processor = image_processor(loaded, profile)
        config = loaded.model.config
        text: Any = config.text_config
        self.hidden = int(text.hidden_size)
        self._kwargs: dict[str, Any] = {} if loaded.family == "qwen2_5_vl" else {
            "vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy,
        }

    async def encode_batch(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        return await asyncio.to_thread(self.encode_now, images)

    def features(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """Blocking: the projected features of each image, [tokens, hidden] in the model's dtype (on the CPU).
        An image the model's processor refuses (Qwen2-VL: aspect ratio over 200) is `InvalidInput`: the
        request's fault, not the engine's."""
        try:
            inputs = self.processor(images=images, return_tensors="pt")
        except ValueError as exc:
            raise InvalidInput(f"the model's image processor refused an image: {exc}") from None
        except MemoryError:   # an image whose processing cannot be allocated (a huge padded square): its fault
            raise InvalidInput("the model's image processor could not allocate an image of this size") from None
        kwargs = dict(self._kwargs)
        if "image_grid_thw" in inputs:
            kwargs["image_grid_thw"] = inputs["image_grid_thw"].to(self.loaded.device)
        with torch.inference_mode():
            out = self.loaded.model.model.get_image_features(
                pixel_values=inputs["pixel_values"].to(self.loaded.device, self.loaded.dtype), **kwargs
            )
        return [f.to("cpu") for f in out.pooler_output]

    def encode_now(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        start = time.monotonic()
        pil = [Image.open(io.BytesIO(img.data)).convert("RGB") for img in images]
        feats = self.features(pil)
        dtype = self.loaded.dtype_name
        encoded: list[EncodedImage] = [TensorEmbedding(f.shape[0], f.shape[1], dtype, f) for f in feats]
        return encoded, time.monotonic() - start
