from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from backends.torch_models import save_random_model
from common.catalog import load_catalog

TINY = "llava-1.5-tiny"
TINY_QWEN = "qwen2.5-vl-tiny"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny LLaVA-1.5 saved once as a local Hugging Face directory (weights + tokenizer)."""
    out = tmp_path_factory.mktemp("tiny-llava")
    save_random_model(load_catalog().model(TINY), out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same for a random-weight tiny Qwen2.5-VL."""
    out = tmp_path_factory.mktemp("tiny-qwen")
    save_random_model(load_catalog().model(TINY_QWEN), out, seed=0)
    return out


@pytest.fixture(scope="session")
def sharp_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight tiny Qwen2.5-VL with its decoder's embeddings and projections ×6 (the vision tower as
    it is): attention then depends enough on positions that 1-D and 3-D positions answer differently."""
    out = tmp_path_factory.mktemp("sharp-qwen")
    save_random_model(load_catalog().model(TINY_QWEN), out, seed=0)
    weights = load_file(str(out / "model.safetensors"))
    decoder = [n for n in weights if n.startswith("model.") and not n.startswith("model.visual.")
               and n.endswith(("proj.weight", "embed_tokens.weight"))]
    assert len(decoder) == 1 + 7 * 2          # the embeddings, and 7 projections in each of the 2 layers
    for name in decoder:
        weights[name] = weights[name] * 6
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
