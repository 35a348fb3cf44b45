"""The monolithic Hugging Face model as the reference: the same weights, the same inputs, `generate()`.

Inputs are built with transformers' own processors (LLaVA: LlavaProcessor, its image processor and its
placeholder expansion; Qwen2.5-VL: its image processor, one <|image_pad|> per grid cell / 4 and the
`mm_token_type_ids` that mark them, as Qwen2_5_VLProcessor builds them), not with the gateway's code, so the
split path is checked against an independent construction. Without `mm_token_type_ids` Hugging Face gives
Qwen2.5-VL 1-D positions (`token_types=False`: what a positions bug would look like).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from common.tokenizer import LLAVA_CHAT_TEMPLATE, QWEN_IMAGE_TOKEN, load_tokenizer


class Reference:
    def __init__(self, model_dir: Path) -> None:
        self.family = json.loads((model_dir / "config.json").read_text())["model_type"]
        qwen = self.family == "qwen2_5_vl"
        cls: Any = (transformers.Qwen2_5_VLForConditionalGeneration if qwen
                    else transformers.LlavaForConditionalGeneration)
        self.model = cls.from_pretrained(str(model_dir), local_files_only=True).eval()
        self.tokenizer = load_tokenizer(str(model_dir), self.family)
        if qwen:
            self.images: Any = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
            return
        side = self.model.config.vision_config.image_size
        self.images = transformers.LlavaImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}, do_pad=True)
        self.processor = transformers.LlavaProcessor(
            image_processor=self.images, tokenizer=self.tokenizer, patch_size=14,
            vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE, num_additional_image_tokens=1)

    def inputs(self, text: str, images: list[bytes], token_types: bool = True) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
        if self.family != "qwen2_5_vl":
            prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            return dict(self.processor(images=pil, text=prompt, return_tensors="pt"))
        prompt = str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        out: dict[str, Any] = dict(self.images(images=pil, return_tensors="pt")) if pil else {}
        pieces = prompt.split(QWEN_IMAGE_TOKEN)
        grids = out.get("image_grid_thw", [])
        prompt = pieces[0] + "".join(QWEN_IMAGE_TOKEN * (int(g.prod()) // 4) + rest
                                     for g, rest in zip(grids, pieces[1:], strict=True))
        out.update(self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False))
        if token_types:   # 1 at image tokens, 0 elsewhere: the 3-D M-RoPE positions need them
            out["mm_token_type_ids"] = (out["input_ids"] == self.model.config.image_token_id).int()
        return out

    def generate_ids(self, text: str, images: list[bytes], max_tokens: int, token_types: bool = True) -> (
        tuple[list[int], int]
    ):
        """(completion ids, prompt length) of greedy decoding."""
        inputs = self.inputs(text, images, token_types)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        n = inputs["input_ids"].shape[1]
        return out[0, n:].tolist(), n

    def generate(self, text: str, images: list[bytes], max_tokens: int, token_types: bool = True) -> (
        tuple[str, int, int]
    ):
        """(text, prompt tokens, completion tokens)."""
        ids, n = self.generate_ids(text, images, max_tokens, token_types)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)), n, len(ids)
