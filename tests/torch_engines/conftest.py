from __future__ import annotations

from pathlib import Path

import pytest

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
