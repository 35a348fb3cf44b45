"""The central promise: a request split over a torch vision engine and a torch language engine (real
processes, real gRPC) gives token for token the monolithic Hugging Face model's greedy answer.

One gateway for the module: one vision engine, one language engine and one `both` (monolithic) engine,
all loading the same saved random-weight tiny LLaVA-1.5; round robin alternates the language requests
between the split and the monolithic engine, and both must answer exactly. References come from
`generate()` of the full model in the test process.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, run_gateway, write_config
from tests.torch_engines.conftest import TINY
from tests.torch_engines.reference import Reference
from tests.torch_engines.split_client import ask_on, client, images, launch, user_message


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def split_gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    cfg = write_config(tmp_path_factory.mktemp("split"), {
        "model": TINY,
        "gateway": {"routing": {"policy": "round_robin"}, "stealing": {"enabled": False}},
        "backends": [
            {"id": "vision-0", "role": "vision", "gpu": "RTX-4090", "launch": launch(tiny_model_dir)},
            {"id": "lang-0", "role": "language", "gpu": "H100", "launch": launch(tiny_model_dir)},
            {"id": "both-0", "role": "both", "gpu": "A100-80GB", "launch": launch(tiny_model_dir)},
        ],
    })
    with run_gateway(cfg, timeout=180) as gw:
        yield gw


def ask(gw: Gateway, text: str, imgs: list[bytes], max_tokens: int) -> tuple[str, int, int]:
    return ask_on(gw, TINY, text, imgs, max_tokens)[0]


@pytest.mark.parametrize("n_images", [1, 3])
def test_split_and_both_equal_monolithic_generate(split_gateway: Gateway, reference: Reference, n_images: int) -> (
    None
):
    imgs = images(n_images, seed=n_images)
    want = reference.generate("What is in the picture? ünïcödé ✓", imgs, 24)
    runs = [ask_on(split_gateway, TINY, "What is in the picture? ünïcödé ✓", imgs, 24) for _ in range(2)]
    answers = {backend: answer for answer, backend in runs}
    assert answers == {"lang-0": want, "both-0": want}   # round robin: once split, once monolithic


def test_split_streamed_equals_generate(split_gateway: Gateway, reference: Reference) -> None:
    imgs = images(2, seed=5)
    want_text, want_prompt, want_completion = reference.generate("Stream it", imgs, 20)
    stream = client(split_gateway).chat.completions.create(
        model=TINY, messages=user_message("Stream it", imgs), max_tokens=20, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert text == want_text
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (want_prompt, want_completion)


def test_exact_while_others_join_and_leave(split_gateway: Gateway, reference: Reference) -> None:
    """Requests of different lengths, with and without images, overlap in the language engine's batch."""
    jobs = [(f"request {i} " + "x" * (7 * i), images(i % 3, seed=10 + i), 6 + 5 * i) for i in range(6)]
    wants = [reference.generate(*job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: ask(split_gateway, *job), jobs))
    assert got == wants


def test_unsupported_sampling_field_is_400(split_gateway: Gateway) -> None:
    resp = httpx.post(f"{split_gateway.url}/v1/chat/completions", timeout=30, json={
        "model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logit_bias": {"7": 5},
    })
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "logit_bias"


def test_heartbeats_report_the_slot_cache(split_gateway: Gateway) -> None:
    lang = split_gateway.backend("lang-0")
    # 8 slots × 256 tokens × (2 · 2 layers · 2 kv heads · 16 dims · 4 bytes)
    assert lang["kv_total_bytes"] == 8 * 256 * 2 * 2 * 2 * 16 * 4
    assert lang["kv_free_bytes"] == lang["kv_total_bytes"]
