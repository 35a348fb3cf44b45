"""Reading the context length out of an engine's /v1/models listing."""

from __future__ import annotations

from typing import Any

import pytest

from common.upstream_models import max_model_len

VLLM = {"object": "list", "data": [
    {"id": "base", "object": "model", "max_model_len": 32768},
    {"id": "lora-a", "object": "model", "max_model_len": 8192, "parent": "base"},
]}


@pytest.mark.parametrize(("listing", "model", "expected"), [
    (VLLM, None, 32768),
    (VLLM, "lora-a", 8192),
    (VLLM, "not-served", 32768),                                    # not listed: the first that says
    ({"data": [{"id": "m"}, {"id": "n", "max_model_len": 4096}]}, None, 4096),
    ({"object": "list", "data": [{"id": "m", "object": "model"}]}, None, None),   # TensorRT-LLM: no field
    ({"data": [{"id": "m", "max_model_len": 0}]}, None, None),
    ({"data": [{"id": "m", "max_model_len": "4096"}]}, None, None),
    ({"data": [{"id": "m", "max_model_len": True}]}, None, None),
    ({"data": "nope"}, None, None),
    ([1, 2], None, None),
])
def test_max_model_len(listing: Any, model: str | None, expected: int | None) -> None:
    assert max_model_len(listing, model) == expected
