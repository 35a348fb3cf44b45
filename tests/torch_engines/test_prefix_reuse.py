"""Prefix reuse through the gateway on real (tiny, random-weight) torch engines.

Two torch language engines behind the default policy with cache-aware routing. A second request that
shares a long prefix with the first goes back to the engine that served the first (the gateway's index
predicts the hit, both being idle), which takes the freed slot holding that prefix and prefills only the
rest: its answer is still the monolithic model's `generate()`, and the engine reports the reused tokens
as prefix-cache hits, which the gateway shows against its own prediction.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, run_gateway, write_config
from tests.torch_engines.conftest import TINY
from tests.torch_engines.reference import Reference
from tests.torch_engines.split_client import ask_on, client, launch

BACKENDS = ("lang-a", "lang-b")
SHARED = "You answer questions about the refund policy, briefly and politely, citing the rule. " * 2


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    cfg = write_config(tmp_path_factory.mktemp("torch-prefix"), {
        "model": TINY,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": b, "role": "language", "gpu": "H100", "launch": launch(tiny_model_dir)}
                     for b in BACKENDS],
    })
    with run_gateway(cfg, timeout=180) as g:
        yield g


def test_a_shared_prefix_goes_back_to_its_engine_which_reuses_it_exactly(gw: Gateway, tiny_model_dir: Path) -> None:
    reference = Reference(tiny_model_dir)
    first, home = ask_on(gw, TINY, SHARED + "What is the window?", [], 6)
    assert first == reference.generate(SHARED + "What is the window?", [], 6)
    second, backend = ask_on(gw, TINY, SHARED + "And for gifts?", [], 6)
    assert backend == home                       # both idle: the predicted hit decides
    assert second == reference.generate(SHARED + "And for gifts?", [], 6)   # computed from the reused KV
    assert second[1] > 160                       # a prompt of that many tokens, most of them reused

    def reported() -> dict[str, int]:
        return gw.backend(home)["prefix_cache"]  # type: ignore[no-any-return]

    gw.wait_until(lambda: reported()["reported_hit_tokens"] >= 128)
    cache = reported()
    assert cache["source"] == "engine" and cache["predicted_hit_tokens"] >= 128
    other = next(b for b in BACKENDS if b != home)
    assert gw.backend(other)["prefix_cache"]["reported_hit_tokens"] == 0
    # and the client is told: OpenAI's usage.prompt_tokens_details.cached_tokens, the slot's reused tokens
    third = client(gw).chat.completions.create(model=TINY, messages=[{"role": "user", "content": SHARED + "Books?"}],
                                               max_tokens=2, temperature=0)
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    assert 128 <= (third.usage.prompt_tokens_details.cached_tokens or 0) < third.usage.prompt_tokens


def test_a_prompt_of_token_ids_is_the_model_input_itself(gw: Gateway, tiny_model_dir: Path) -> None:
    """/v1/completions with the chat's own token ids (as vLLM takes them) gives the chat's answer; an id past
    the tokenizer's vocabulary is refused by name, before any engine sees it."""
    reference = Reference(tiny_model_dir)
    question = SHARED + "Who pays for the return?"
    ids = reference.inputs(question, [])["input_ids"][0].tolist()
    answer = client(gw).completions.create(model=TINY, prompt=ids, max_tokens=6, temperature=0)
    text, prompt_tokens, completion_tokens = reference.generate(question, [], 6)
    assert answer.choices[0].text == text
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        prompt_tokens, completion_tokens)
    vocab = len(reference.tokenizer)
    resp = httpx.post(f"{gw.url}/v1/completions", json={"model": TINY, "prompt": [1, vocab], "max_tokens": 2},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == f"token id {vocab} is outside the model's vocabulary of {vocab} ids"
    # the image placeholder among the ids, no image with it: embedded as a word, where vLLM refuses it
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    resp = httpx.post(f"{gw.url}/v1/completions", json={"model": TINY, "prompt": [1, image_id, 5], "max_tokens": 2},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(f"token id {image_id} is the model's image placeholder")
