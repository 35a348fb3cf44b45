"""The model's tokenizer, shared by the gateway (exact prompt ids and L_r) and the torch engines (detokenising).

`load_tokenizer(path)` reads a local Hugging Face directory and never downloads. A model built with random
weights has no tokenizer files, so `byte_tokenizer()` builds one in memory: the 256 bytes plus five special
tokens, byte-level (any UTF-8 text round-trips, multi-byte characters span several tokens) with LLaVA-1.5's
chat template. Its ids are the tiny catalog models' vocabulary (see configs/hf/llava-1.5-tiny.json).

transformers is imported on first use: a gateway without torch engines never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heterogate.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IMAGE_TOKEN = "<image>"
BYTE_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN)   # ids 0..4; bytes are 5..260

# LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT:"; each image part is one <image>.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}USER: {% elif m['role'] == 'assistant' %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}</s>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    vocab = {s: i for i, s in enumerate(BYTE_SPECIALS)}
    for char in byte_chars.values():
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in BYTE_SPECIALS])
    fast: Any = PreTrainedTokenizerFast
    tok: PreTrainedTokenizerBase = fast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok


def load_tokenizer(model_path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer in `model_path` (local files only), or the byte tokenizer when there is no path."""
    if model_path is None:
        return byte_tokenizer()
    path = Path(model_path)
    if not (path / "tokenizer_config.json").is_file():
        raise ConfigError(f"{path / 'tokenizer_config.json'}: no tokenizer in the model directory")
    from transformers import AutoTokenizer

    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.chat_template is None:
        tok.chat_template = LLAVA_CHAT_TEMPLATE
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
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    raw: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    images = iter(image_tokens)
    for t in raw:
        if t == image_id:
            n = next(images, None)
            if n is None:
                raise ValueError(f"the prompt has more {IMAGE_TOKEN} placeholders than images")
            spans.append((len(ids), n))
            ids.extend([image_id] * n)
        else:
            ids.append(t)
    if len(spans) != len(image_tokens):
        raise ValueError(f"{len(image_tokens)} images but {len(spans)} {IMAGE_TOKEN} placeholders in the prompt")
    return PromptIds(ids, spans)
