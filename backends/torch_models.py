"""Loading a vision-language model (LLaVA-1.5 or Qwen2.5-VL) for the torch executors, from local files or
random weights.

`model_path`: a local Hugging Face directory (config.json, *.safetensors, tokenizer); read with
`local_files_only`, so a missing file is a `ConfigError` naming the path, never a download.
`random_weights`: the catalog's Hugging Face config (configs/hf/) built with seeded random weights; the
same seed gives the same weights in every engine process, so a split vision + language pair matches the
monolithic model. Every token but printable ASCII is suppressed (the generation config's `suppress_tokens`:
its logit is -inf, so neither greedy decoding nor sampling ever picks it), so that a random model says
legible text in which one character is one token (its answers compare token for token as text; it never
says EOS). `save` writes that list to generation_config.json, which `model_path` reads back, as Hugging
Face's `generate()` does. Each side builds and reads only the half it runs (the vision engine the vision
tower and projector, the language engine the decoder and LM head; backends/torch_weights.py).

    python -m backends.torch_models save DIR [--model llava-1.5-tiny] [--seed 0]

writes a random-weight model with the byte tokenizer to DIR, for `model_path` and for tests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from backends.torch_weights import build_half, init_random, load_safetensors
from common.catalog import HF_CONFIG_DIR, ModelProfile, load_catalog
from common.errors import ConfigError
from common.tokenizer import image_token, load_tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Family:
    config: type[PretrainedConfig]
    model: Any
    vision_parts: tuple[str, ...]     # attributes of `model.model` that only the vision side runs


FAMILIES = {
    "llava": Family(LlavaConfig, LlavaForConditionalGeneration, ("vision_tower", "multi_modal_projector")),
    "qwen2_5_vl": Family(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, ("visual",)),
}


@dataclass
class LoadedModel:
    model: Any                        # a *ForConditionalGeneration of one of FAMILIES
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    family: str

    @property
    def suppressed(self) -> list[int]:
        """The token ids never to choose: the generation config's `suppress_tokens`."""
        return list(self.model.generation_config.suppress_tokens or [])

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def hf_config(profile: ModelProfile) -> Any:
    if profile.hf_config is None:
        raise ConfigError(f"model {profile.name!r} has no Hugging Face config in the catalog (hf_config)")
    path = HF_CONFIG_DIR / profile.hf_config
    data: dict[str, Any] = json.loads(path.read_text())
    return family_of(data.get("model_type"), str(path)).config.from_dict(data)


def family_of(model_type: Any, where: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: the torch executor runs {' and '.join(FAMILIES)} models; model_type is "
                          f"{model_type!r}")
    return FAMILIES[model_type]


def resolve_dtype(name: str, profile: ModelProfile) -> torch.dtype:
    key = profile.dtype if name == "auto" else name
    if key not in DTYPES:
        raise ConfigError(f"dtype {key!r} is not one torch runs ({', '.join(DTYPES)})")
    return DTYPES[key]


def resolve_device(name: str) -> torch.device:
    """The device to run on, checked before anything is allocated: a device this machine does not have is a
    `ConfigError` naming it and what there is, not an assertion from deep inside torch's CUDA start-up."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not one torch knows (cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            why = f"this machine has {count} CUDA device(s)" if torch.version.cuda else (
                "this torch is built without CUDA")
            raise ConfigError(f"device {name!r} does not exist here: {why}")
    elif dev.type != "cpu":
        raise ConfigError(f"device {name!r}: the torch executor runs on cpu, cuda or cuda:N")
    return dev


def load_model(
    profile: ModelProfile, *, model_path: str | None, seed: int, dtype: str, device: str, keep: str
) -> LoadedModel:
    """`keep`: "vision" (tower + projector), "language" (decoder + head) or "both"; only that is ever allocated
    and only its weights are read (backends/torch_weights.py)."""
    torch_dtype = resolve_dtype(dtype, profile)
    dev = resolve_device(device)
    if model_path is not None:
        path = Path(model_path)
        for name in ("config.json", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise ConfigError(f"{path / name}: missing (model_path must be a local Hugging Face directory)")
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"{path}: no *.safetensors weights in the model directory")
        data = json.loads((path / "config.json").read_text())
        family_name, family = data.get("model_type"), family_of(data.get("model_type"), str(path / "config.json"))
        config = family.config.from_dict(data)
        tokenizer = load_tokenizer(model_path, family_name)
    else:
        config = hf_config(profile)
        family_name, family = config.model_type, FAMILIES[config.model_type]
        tokenizer = load_tokenizer(None, family_name)
        _speak_byte_tokenizer(config, tokenizer)
    model, names = build_half(family.model, config, family.vision_parts, keep=keep, dtype=torch_dtype, device=dev)
    if model_path is not None:
        load_safetensors(model, names, Path(model_path))
        if (Path(model_path) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(model_path, local_files_only=True)
    else:
        init_random(model, seed)
        if keep != "vision":
            _printable_only(model, tokenizer)
    model.eval()
    return LoadedModel(model, tokenizer, torch_dtype, dev, family_name)


def _speak_byte_tokenizer(config: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """A random-weight model reads the byte tokenizer's ids, so its config's placeholder ids become that
    tokenizer's (the tiny configs already agree; the 7B configs carry their real tokenizers' ids, which the
    language engine's M-RoPE positions would otherwise look for)."""
    tokens = {"image_token_id": image_token(tokenizer)}
    if config.model_type == "qwen2_5_vl":
        tokens |= {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
                   "vision_end_token_id": "<|vision_end|>"}
    for attr, token in tokens.items():
        setattr(config, attr, tokenizer.convert_tokens_to_ids(token))


def _printable_only(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """Suppress every token of the LM head but the 95 printable ASCII characters (EOS and the specials too)."""
    printable = {tokenizer.encode(chr(c), add_special_tokens=False)[0] for c in range(0x20, 0x7F)}
    model.generation_config.suppress_tokens = [i for i in range(model.lm_head.weight.shape[0]) if i not in printable]


def save_random_model(profile: ModelProfile, out: Path, seed: int = 0) -> None:
    """A random-weight model with the byte tokenizer, as a local Hugging Face directory."""
    loaded = load_model(profile, model_path=None, seed=seed, dtype="auto", device="cpu", keep="both")
    loaded.model.save_pretrained(str(out))
    loaded.tokenizer.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m backends.torch_models")
    sub = p.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="write a random-weight model and its tokenizer to DIR")
    save.add_argument("dir", type=Path)
    save.add_argument("--model", default="llava-1.5-tiny")
    save.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    save_random_model(load_catalog().model(args.model), args.dir, args.seed)
    print(args.dir)


if __name__ == "__main__":
    main()
