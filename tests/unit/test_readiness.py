"""Which pools `/ready` waits for: the vision pool only when the cluster serves images and some
language backend needs a separate encoder for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.cluster import load_cluster
from gateway.runtime import needs_vision_pool

LANG = "{id: l0, role: language, gpu: H100, launch: {}}"
VISION = "{id: v0, role: vision, gpu: L40S, launch: {}}"
BOTH = "{id: b0, role: both, gpu: H100, launch: {}}"
UPSTREAM = "{id: u0, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000'}"


@pytest.mark.parametrize(("model", "backends", "needed"), [
    ("llava-1.5-7b", [LANG, VISION], True),        # the split: language engines wait for encoders
    ("llava-1.5-7b", [LANG], False),               # no encoders: images are not served, text is
    ("llava-1.5-7b", [BOTH, VISION], False),       # monolithic backends encode their own images
    ("llava-1.5-7b", [UPSTREAM, VISION], False),   # the upstream reads images itself
    ("llama-2-7b", [LANG], False),                 # a text model
])
def test_vision_pool_needed(tmp_path: Path, model: str, backends: list[str], needed: bool) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(f"model: {model}\nbackends:\n" + "".join(f"  - {b}\n" for b in backends))
    assert needs_vision_pool(load_cluster(path)) is needed
