"""The model's tokenizer, shared by the gateway (exact prompt ids and L_r) and the torch engines (detokenising).

`load_tokenizer(path)` reads a local Hugging Face directory and never downloads. A model built with random
weights has no tokenizer files, so `byte_tokenizer(family)` builds one in memory: the family's special tokens
then the 256 bytes, byte-level (any UTF-8 text round-trips, multi-byte characters span several tokens), with
the family's chat template (LLaVA-1.5 or Qwen2.5-VL). Its ids are the tiny catalog models' vocabulary (see
configs/hf/*-tiny.json).

transformers is imported on first use: a gateway without torch engines never loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.catalog import HF_CONFIG_DIR, ModelProfile
from common.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMAGE_TOKEN = "<image>"
BYTE_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN)   # ids 0..4; bytes are 5..260
QWEN_IMAGE_TOKEN = "<|image_pad|>"
# ids 0..6; bytes are 7..262
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", QWEN_IMAGE_TOKEN, "<|video_pad|>",
                 "<|vision_start|>", "<|vision_end|>")

# LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT:"; each image part is one <image>.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}USER: {% elif m['role'] == 'assistant' %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}</s>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# Qwen2.5-VL's ChatML, without its default system message.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(family: str = "llava") -> PreTrainedTokenizerBase:
    """`family`: the Hugging Face model_type, "llava" or "qwen2_5_vl"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    qwen = family == "qwen2_5_vl"
    specials = QWEN_SPECIALS if qwen else BYTE_SPECIALS
    vocab = {s: i for i, s in enumerate(specials)}
    for char in byte_chars.values():
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None if qwen else "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast: Any = PreTrainedTokenizerFast
    names = ({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"} if qwen else
             {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    tok: PreTrainedTokenizerBase = fast(
        tokenizer_object=backend, **names,
        extra_special_tokens={"image_token": QWEN_IMAGE_TOKEN if qwen else IMAGE_TOKEN},
    )
    tok.chat_template = QWEN_CHAT_TEMPLATE if qwen else LLAVA_CHAT_TEMPLATE
    return tok


def image_token(tok: PreTrainedTokenizerBase) -> str:
    """The placeholder token that stands for one image token in the prompt."""
    return str(getattr(tok, "image_token", None) or IMAGE_TOKEN)


def model_family(profile: ModelProfile, model_path: str | None = None) -> str:
    """The Hugging Face model_type of a model directory (one with a config.json), or of the catalog's
    config for the model."""
    if model_path is not None and (Path(model_path) / "config.json").is_file():
        config = Path(model_path) / "config.json"
    elif profile.hf_config is not None:
        config = HF_CONFIG_DIR / profile.hf_config
    else:
        raise ConfigError(f"model {profile.name!r} has no Hugging Face config in the catalog (hf_config)")
    return str(json.loads(config.read_text()).get("model_type"))


def load_tokenizer(model_path: str | None, family: str = "llava") -> PreTrainedTokenizerBase:
    """The tokenizer in `model_path` (local files only), or the family's byte tokenizer when there is no path."""
    if model_path is None:
        return byte_tokenizer(family)
    path = Path(model_path)
    if not (path / "tokenizer_config.json").is_file():
        raise ConfigError(f"{path / 'tokenizer_config.json'}: no tokenizer in the model directory")
    from transformers import AutoTokenizer

    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.chat_template is None:
        tok.chat_template = QWEN_CHAT_TEMPLATE if family == "qwen2_5_vl" else LLAVA_CHAT_TEMPLATE
    return tok


@dataclass(frozen=True, slots=True)
class PromptIds:
    """A rendered, tokenised prompt whose image placeholders are expanded to the images' token counts."""

    ids: list[int]
    image_spans: list[tuple[int, int]]   # (start, length) of each image's placeholder run, in order

    @property
    def text_tokens(self) -> int:
        return len(self.ids) - sum(n for _, n in self.image_spans)


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], image_tokens: list[int]) -> PromptIds:
    """Render `messages` (content parts `{"type": "text"|"image"}`) with the chat template and tokenise;
    the i-th image placeholder becomes `image_tokens[i]` copies of the image token."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return encode_text(tok, str(text), image_tokens)


def encode_text(tok: PreTrainedTokenizerBase, text: str, image_tokens: list[int]) -> PromptIds:
    placeholder = image_token(tok)
    image_id = tok.convert_tokens_to_ids(placeholder)
    raw: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    images = iter(image_tokens)
    for t in raw:
        if t == image_id:
            n = next(images, None)
            if n is None:
                raise ValueError(f"the prompt has more {placeholder} placeholders than images")
            spans.append((len(ids), n))
            ids.extend([image_id] * n)
        else:
            ids.append(t)
    if len(spans) != len(image_tokens):
        raise ValueError(f"{len(image_tokens)} images but {len(spans)} {placeholder} placeholders in the prompt")
    return PromptIds(ids, spans)
