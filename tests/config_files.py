"""backends.yaml files for config tests: write one for the demo model, expect its ConfigError."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
from gateway.config.cluster import load_cluster
from tests.snapshots import catalog


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-1.5-7b\n" + body)
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_cluster(path, catalog())
    return str(exc.value)
