"""Torch launches in backends.yaml: weights named exactly once, never downloaded, one model per cluster;
the catalog's figures agree with the Hugging Face configs the engines build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.torch_models import FAMILIES, hf_config
from gateway.config import load_cluster
from gateway.launchers import engine_argv
from heterogate.catalog import load_catalog
from heterogate.errors import ConfigError
from tests.harness import write_config


def cluster(tmp: Path, *launches: dict[str, Any], model: str = "llava-1.5-tiny") -> Path:
    return write_config(tmp, {"model": model, "backends": [
        {"id": f"b{i}", "role": "language", "gpu": "H100", "launch": launch} for i, launch in enumerate(launches)
    ]})


@pytest.mark.parametrize("launch, message", [
    ({"executor": "torch"}, "exactly one of `model_path` and `random_weights"),
    ({"executor": "torch", "random_weights": True, "model_path": "/x"}, "exactly one of"),
    ({"executor": "torch", "model_path": "/no/such/dir"}, "model_path /no/such/dir: no config.json"),
    ({"random_weights": True}, "need `executor: torch`"),
    ({"executor": "torch", "random_weights": True, "device": "gpu0"}, "device"),
])
def test_bad_torch_launches_are_config_errors(tmp_path: Path, launch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_cluster(cluster(tmp_path, launch))


def test_a_model_without_hf_config_cannot_run_on_torch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"llama-2-7b.*no Hugging Face config"):
        load_cluster(cluster(tmp_path, {"executor": "torch", "random_weights": True}, model="llama-2-7b"))


def test_torch_engines_must_run_one_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run different weights"):
        load_cluster(cluster(tmp_path, {"executor": "torch", "random_weights": True, "seed": 0},
                             {"executor": "torch", "random_weights": True, "seed": 1}))


def test_torch_launch_reaches_the_engine_command_line(tmp_path: Path) -> None:
    config = load_cluster(cluster(tmp_path, {"executor": "torch", "random_weights": True, "seed": 3,
                                             "dtype": "bfloat16", "max_model_len": 512}, {}))
    argv = engine_argv(config, config.raw.backends[0], "127.0.0.1:1", "info")
    assert argv[argv.index("--executor") + 1] == "torch" and "--random-weights" in argv
    assert argv[argv.index("--seed") + 1] == "3" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--max-model-len") + 1] == "512"
    assert "--executor" not in engine_argv(config, config.raw.backends[1], "127.0.0.1:1", "info")
    assert config.torch_weights == (None, 3)


@pytest.mark.parametrize("name", ["llava-1.5-tiny", "llava-1.5-7b", "qwen2.5-vl-tiny"])
def test_catalog_figures_match_the_hf_config(name: str) -> None:
    profile = load_catalog().model(name)
    config = hf_config(profile)
    text, vision = config.text_config, config.vision_config
    assert (profile.layers, profile.kv_heads, profile.hidden) == (
        text.num_hidden_layers, text.num_key_value_heads, text.hidden_size)
    assert profile.head_dim == text.hidden_size // text.num_attention_heads
    assert profile.vision is not None
    family = FAMILIES[config.model_type]
    if profile.vision.mode == "fixed":
        assert profile.vision.tokens_per_image == (vision.image_size // vision.patch_size) ** 2
    else:
        assert profile.vision.pixels_per_token_side == vision.patch_size * vision.spatial_merge_size
    with torch.device("meta"):
        model = family.model(config)
    assert abs(sum(p.numel() for p in model.parameters()) / profile.params - 1) < 0.01
    encoder = sum(p.numel() for part in family.vision_parts[:1] for p in getattr(model.model, part).parameters())
    assert abs(encoder / profile.vision.encoder_params - 1) < 0.01
