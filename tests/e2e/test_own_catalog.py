"""A backends.yaml naming a catalog of its own (`catalog:`, as `gateway plan --catalog` writes it): the
gateway resolves its GPUs there and starts its managed engines with it, so a GPU only that catalog has
serves."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from common.catalog import CONFIG_DIR
from testkit.harness import run_gateway

MODEL = "llava-1.5-7b"


def test_a_gpu_of_the_files_own_catalog_is_launched_and_serves(tmp_path: Path) -> None:
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    own = tmp_path / "catalog"
    own.mkdir()
    (own / "gpus.yaml").write_text(yaml.safe_dump({"MI300X": {**gpus["H100"], "price_per_hour": 3.0}}))
    (own / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    config = tmp_path / "backends.yaml"
    config.write_text(yaml.safe_dump({"catalog": "catalog", "model": MODEL,
                                      "backends": [{"id": "mi300x-0", "gpu": "MI300X", "launch": {}}]}))
    with run_gateway(config, healthy=1) as gw:
        assert gw.backend("mi300x-0")["gpu"] == "MI300X"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-heterogate-backend"] == "mi300x-0", resp.text
