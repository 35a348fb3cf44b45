"""Exact prompts for backends that run a real model: the model's chat template and tokenizer at the gateway.

With torch engines in the cluster the gateway renders the chat with the model's template, tokenises it
and expands each image placeholder to the image's token count. The request then carries the exact ids
(L_r for routing and limits is exact too) and where each image's embedding goes; the engine does not
tokenise again. Without torch engines the 4-bytes-per-token estimate of `gateway.requests.tokens` stays.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.catalog import ModelProfile
from common.tokenizer import PromptIds, encode_chat, encode_text, image_token, load_tokenizer, model_family
from gateway.requests.errors import InvalidRequest
from gateway.requests.images import ImageInput
from gateway.requests.openai_types import ChatMessage, ImagePart, TextPart


class ExactPrompts:
    def __init__(self, model: ModelProfile, model_path: str | None) -> None:
        self._model = model
        self._tok = load_tokenizer(model_path, model_family(model, model_path))   # blocking, once at start-up
        # where prompts are tokenized off the event loop, one at a time (a Hugging Face fast tokenizer is not
        # safe to call from two threads at once)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def grids(self, images: tuple[ImageInput, ...]) -> tuple[tuple[int, int, int], ...]:
        """Qwen2-VL family: each image's patch grid, for the language engine's M-RoPE positions; else ()."""
        grids = [self._model.image_grid_thw(img.width, img.height) for img in images]
        return tuple(g for g in grids if g is not None)

    def chat(self, messages: list[ChatMessage], images: tuple[ImageInput, ...]) -> PromptIds:
        rendered = [{"role": m.role, "content": _content(m)} for m in messages]
        try:
            return encode_chat(self._tok, rendered, [img.tokens for img in images])
        except ValueError as exc:   # e.g. a literal "<image>" in the text
            raise InvalidRequest(str(exc), param="messages") from None

    def text(self, prompt: str) -> PromptIds:
        bos = str(self._tok.bos_token or "")
        try:
            return encode_text(self._tok, bos + prompt, [])
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="prompt") from None

    def check_ids(self, ids: list[int]) -> None:
        """A prompt of token ids the model can read: every id within its tokenizer's vocabulary (an id past
        it would index past the engine's embedding table), and no image placeholder (such a prompt carries
        no image for it: the engine embedded it as a word, where vLLM refuses a placeholder without its image)."""
        vocab = len(self._tok)
        if (largest := max(ids)) >= vocab:
            raise InvalidRequest(f"token id {largest} is outside the model's vocabulary of {vocab} ids", param="prompt")
        placeholder = image_token(self._tok)
        image_id = self._tok.convert_tokens_to_ids(placeholder)
        if isinstance(image_id, int) and image_id in ids:
            raise InvalidRequest(f"token id {image_id} is the model's image placeholder ({placeholder}), and a prompt "
                                 "of token ids carries no image: send images in a chat message", param="prompt")


def _content(message: ChatMessage) -> str | list[dict[str, Any]]:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in message.content if isinstance(p, TextPart | ImagePart)]
