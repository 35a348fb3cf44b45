"""Each engine builds and reads only the half it runs, and that half equals the same part of the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.torch_models import FAMILIES, load_model
from common.catalog import load_catalog
from common.errors import ConfigError
from tests.torch_engines.conftest import TINY, TINY_QWEN
from tests.torch_engines.reference import Reference

LANGUAGE_PARTS = ("model.language_model.", "lm_head.")


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (non-persistent ones too: rotary frequencies, position ids) by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", [TINY, TINY_QWEN])
@pytest.mark.parametrize("source", ["model_path", "random_weights"])
def test_each_half_holds_only_its_weights(name: str, source: str, request: pytest.FixtureRequest) -> None:
    """A vision engine holds no language weights and a language engine no vision weights; what each holds
    (buffers included) is bit-equal to the whole model's, from a checkpoint and from the same seed alike.
    The model directory was itself written from random weights of seed 0, so both sources are one model."""
    model_dir: Path = request.getfixturevalue("tiny_model_dir" if name == TINY else "tiny_qwen_dir")
    profile = load_catalog().model(name)
    whole = tensors(Reference(model_dir).model)
    vision_parts = tuple(f"model.{p}." for p in FAMILIES["llava" if name == TINY else "qwen2_5_vl"].vision_parts)
    path = str(model_dir) if source == "model_path" else None
    halves = {keep: tensors(load_model(profile, model_path=path, seed=0, dtype="float32", device="cpu",
                                       keep=keep).model) for keep in ("vision", "language", "both")}
    assert halves["vision"] and all(n.startswith(vision_parts) for n in halves["vision"])
    assert halves["language"] and not any(n.startswith(vision_parts) for n in halves["language"])
    assert all(n.startswith(LANGUAGE_PARTS) for n in halves["language"])
    assert set(halves["both"]) == set(whole) == set(halves["vision"]) | set(halves["language"])
    for held in halves.values():
        for n, t in held.items():
            assert torch.equal(t, whole[n]), n


def test_a_checkpoint_missing_a_tensor_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Only the vision half's tensors are read for a vision engine: a checkpoint without the decoder still
    loads one, and a language engine's start-up names what it lacks."""
    for file in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (tmp_path / file).write_bytes((tiny_model_dir / file).read_bytes())
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("language_model.")},
              str(tmp_path / "model.safetensors"))
    profile = load_catalog().model(TINY)
    load_model(profile, model_path=str(tmp_path), seed=0, dtype="auto", device="cpu", keep="vision")
    with pytest.raises(ConfigError, match=rf"{tmp_path}: the checkpoint lacks lm_head.weight, model.language_model"):
        load_model(profile, model_path=str(tmp_path), seed=0, dtype="auto", device="cpu", keep="language")
