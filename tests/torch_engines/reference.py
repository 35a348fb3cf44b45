"""The monolithic Hugging Face model as the reference: the same weights, the same inputs, `generate()`.

Inputs are built with transformers' own LlavaProcessor (its image processor and placeholder expansion),
not with the gateway's code, so the split path is checked against an independent construction.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration, LlavaImageProcessorPil, LlavaProcessor

from heterogate.tokenizer import LLAVA_CHAT_TEMPLATE, load_tokenizer


class Reference:
    def __init__(self, model_dir: Path) -> None:
        self.model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), local_files_only=True).eval()
        self.tokenizer = load_tokenizer(str(model_dir))
        side = self.model.config.vision_config.image_size
        images = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                        do_pad=True)
        self.processor = LlavaProcessor(image_processor=images, tokenizer=self.tokenizer, patch_size=14,
                                        vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                                        num_additional_image_tokens=1)

    def inputs(self, text: str, images: list[bytes]) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
        return dict(self.processor(images=pil, text=prompt, return_tensors="pt"))

    def generate_ids(self, text: str, images: list[bytes], max_tokens: int) -> tuple[list[int], int]:
        """(completion ids, prompt length) of greedy decoding."""
        inputs = self.inputs(text, images)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        n = inputs["input_ids"].shape[1]
        return out[0, n:].tolist(), n

    def generate(self, text: str, images: list[bytes], max_tokens: int) -> tuple[str, int, int]:
        """(text, prompt tokens, completion tokens)."""
        ids, n = self.generate_ids(text, images, max_tokens)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)), n, len(ids)
