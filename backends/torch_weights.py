"""Building only the half of a vision-language model that an engine runs, so start-up never holds the other half.

The model is laid out on the meta device (no memory), the parts the engine does not run are deleted, and only
then is the rest allocated on the target device: a vision engine never allocates the decoder, a language engine
never allocates the vision tower. Buffers (rotary frequencies, position ids) are recomputed by the model's own
`_init_weights`, as Hugging Face does after a meta-device build.

Weights then come from one of two places:
- `load_safetensors`: the tensors of a local checkpoint that the kept parts name, read one by one from the
  memory-mapped files (the other half's tensors are never read); checkpoint names are mapped to module names
  with transformers' own renaming rules, so original checkpoints and `save_pretrained` output both load.
- `init_random`: the model's own initialisation, reseeded per module from (seed, module name), so a module gets
  the same weights whichever half (or both) a process builds: a split pair equals the monolithic model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from common.errors import ConfigError

# a checkpoint tensor's name -> (the module parameter it loads, the conversion it needs or None)
CheckpointNames = Callable[[str], tuple[str, "str | None"]]


def build_half(
    model_cls: Any, config: PretrainedConfig, vision_parts: tuple[str, ...], *, keep: str, dtype: torch.dtype,
    device: torch.device,
) -> tuple[Any, CheckpointNames]:
    """The model with only `keep` ("vision", "language" or "both") allocated on `device`, its parameters not yet
    set; and how checkpoint names map to its parameters (resolved on the whole model, before the cut)."""
    with torch.device("meta"):
        model = model_cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    mapping = get_model_conversion_mapping(model)
    names = partial(rename_source_key, weight_renamings=[m for m in mapping if isinstance(m, WeightRenaming)],
                    weight_converters=[m for m in mapping if isinstance(m, WeightConverter)],
                    base_model_prefix=model.base_model_prefix, meta_state_dict=model.state_dict())
    if keep == "vision":
        del model.model.language_model, model.lm_head
    elif keep == "language":
        for part in vision_parts:
            delattr(model.model, part)
    model.to_empty(device=device)
    _reinitialise(model, model, "", buffers_only=True)
    return model, names


def init_random(model: PreTrainedModel, seed: int) -> None:
    """Seeded random weights, module by module (see the module docstring)."""
    _reinitialise(model, model, "", buffers_only=False, seed=seed)


def _reinitialise(owner: Any, module: torch.nn.Module, prefix: str, *, buffers_only: bool, seed: int = 0) -> None:
    """The model's `_init_weights` on every module (children first, as transformers does), each by the nearest
    enclosing PreTrainedModel; `buffers_only`: only modules that own buffers (their parameters are overwritten
    by the checkpoint afterwards)."""
    for name, child in module.named_children():
        _reinitialise(child if isinstance(child, PreTrainedModel) else owner, child, f"{prefix}{name}.",
                      buffers_only=buffers_only, seed=seed)
    if buffers_only and next(module.buffers(recurse=False), None) is None:
        return
    torch.manual_seed(seed ^ zlib.crc32(prefix.encode()))
    owner._init_weights(module)


def load_safetensors(model: Any, names: CheckpointNames, path: Path) -> None:
    """Copy into `model` the checkpoint tensors it has parameters for; every parameter must be found."""
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.tie_weights()
    params = model.state_dict()
    found: set[str] = set()
    with torch.no_grad():
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as tensors:
                for key in tensors.keys():
                    name, converter = names(key)
                    if name not in params:
                        continue
                    if converter is not None:
                        raise ConfigError(f"{file}: tensor {key} needs a conversion this loader does not run")
                    tensor = tensors.get_tensor(key)
                    if tensor.shape != params[name].shape:
                        raise ConfigError(f"{file}: {key} has shape {tuple(tensor.shape)}, the model's {name} "
                                          f"{tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    found.add(name)
    missing = sorted({n for n, _ in model.named_parameters()} - found)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"{path}: the checkpoint lacks {shown}")
