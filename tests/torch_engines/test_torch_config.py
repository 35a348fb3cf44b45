"""Torch launches in backends.yaml: weights named exactly once, never downloaded, one model per cluster;
the catalog's figures agree with the Hugging Face configs the engines build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.torch_models import FAMILIES, hf_config
from common.catalog import load_catalog
from common.errors import ConfigError
from gateway.config.cluster import load_cluster
from gateway.control.launchers import engine_argv
from testkit.harness import write_config


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


# what the catalog's `params` counts (configs/models.yaml): the whole model, or the language model only
LANGUAGE_ONLY_PARAMS = {"qwen2.5-vl-7b"}


@pytest.mark.parametrize("name", ["llava-1.5-tiny", "llava-1.5-7b", "qwen2.5-vl-tiny", "qwen2.5-vl-7b"])
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
    encoder = sum(p.numel() for part in family.vision_parts[:1] for p in getattr(model.model, part).parameters())
    vision_side = sum(p.numel() for part in family.vision_parts for p in getattr(model.model, part).parameters())
    total = sum(p.numel() for p in model.parameters())
    counted = total - vision_side if name in LANGUAGE_ONLY_PARAMS else total
    assert abs(counted / profile.params - 1) < 0.01
    assert abs(encoder / profile.vision.encoder_params - 1) < 0.01


def test_qwen_7b_config_builds_with_the_catalog_shapes() -> None:
    """Qwen2.5-VL-7B from its HF config on the meta device (no weights): the tower turns 14 px patches of 2
    frames into 1280-wide tokens and merges 2x2 of them into the decoder's 3584; the decoder has 28 layers of
    28 query and 4 KV heads of 128; and the catalog's token count for an image is the tower's grid / 4."""
    profile = load_catalog().model("qwen2.5-vl-7b")
    with torch.device("meta"):
        model = FAMILIES["qwen2_5_vl"].model(hf_config(profile))
    visual, lm = model.model.visual, model.model.language_model
    assert visual.patch_embed.proj.weight.shape == (1280, 3, 2, 14, 14)
    assert visual.merger.mlp[0].in_features == 1280 * 4 and visual.merger.mlp[-1].out_features == profile.hidden
    attention = lm.layers[0].self_attn
    assert len(lm.layers) == profile.layers == 28
    assert attention.q_proj.out_features == 28 * profile.head_dim == profile.hidden
    assert attention.k_proj.out_features == profile.kv_heads * profile.head_dim == 512
    assert lm.embed_tokens.weight.shape == model.lm_head.weight.shape == (152064, profile.hidden)
    grid = profile.image_grid_thw(448, 448)
    assert grid == (1, 32, 32) and profile.image_tokens(448, 448) == 32 * 32 // 4


def test_qwen_7b_torch_launch_is_accepted(tmp_path: Path) -> None:
    config = load_cluster(cluster(tmp_path, {"executor": "torch", "random_weights": True, "device": "cuda",
                                             "dtype": "bfloat16"}, model="qwen2.5-vl-7b"))
    assert config.model.name == "qwen2.5-vl-7b" and config.torch_weights == (None, 0)
