"""Per-backend context and KV capacity, as the engines report them or as configured, with gateway-side scraping.

Real processes on 127.0.0.1: three fake engines and the gateway scraping them.
    long   lists max_model_len 32768 in /v1/models; KV from vllm:cache_config_info
    short  lists max_model_len 2048; no KV capacity in its metrics, `kv_capacity_tokens` configured
    plain  SGLang format without max_model_len or capacity; `max_model_len: 40000` configured
The catalog model's own context is 4,096 tokens. /v1/completions prompts of 4·N bytes are N tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from common import perf_model
from common.catalog import load_catalog
from testkit.harness import Gateway, free_port, metric_total, run_gateway, write_config
from tests.e2e.test_errors import assert_openai_error
from tests.e2e.test_external_engines import MODEL, spawn, stop

ENGINES: dict[str, tuple[str, ...]] = {
    "long": ("--engine", "vllm", "--max-model-len", "32768"),
    "short": ("--engine", "vllm", "--max-model-len", "2048", "--no-cache-info"),
    "plain": ("--engine", "sglang"),
}
MAX_PROMPT_TOKENS = 45_000
Cluster = tuple[Gateway, dict[str, str]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp: Path = tmp_path_factory.mktemp("limits")
    urls = {bid: f"http://127.0.0.1:{free_port()}" for bid in ENGINES}
    extra: dict[str, dict[str, Any]] = {"short": {"kv_capacity_tokens": 60_000}, "plain": {"max_model_len": 40_000}}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
                    "limits": {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_tokens": 16_384}},
        "backends": [{"id": bid, "kind": "openai", "gpu": "L40S", "address": urls[bid],
                      "scrape": {"engine": ENGINES[bid][1], "interval_ms": 100}, **extra.get(bid, {})}
                     for bid in ENGINES],
    })
    with ExitStack() as stack:
        for bid, args in ENGINES.items():
            stack.callback(stop, spawn("tests.fake_openai_server", "--port", urls[bid].rsplit(":", 1)[1], *args))
        yield stack.enter_context(run_gateway(config, timeout=30)), urls


def complete(gw: Gateway, prompt_tokens: int, max_tokens: int | None = 8) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "prompt": "x" * (4 * prompt_tokens)}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)


def served(urls: dict[str, str]) -> dict[str, int]:
    return {bid: int(httpx.get(f"{url}/stats", timeout=5).json()["served"]) for bid, url in urls.items()}


def test_admin_backends_shows_each_limit_and_where_it_comes_from(cluster: Cluster) -> None:
    gw, _ = cluster
    model = load_catalog().model(MODEL)
    bpt = model.kv_bytes_per_token
    b = {x["id"]: x for x in gw.backends()}
    assert [(b[i]["max_model_len"], b[i]["context_source"]) for i in ENGINES] == [
        (32768, "engine"), (2048, "engine"), (40_000, "config")]
    assert [b[i]["kv_capacity_source"] for i in ENGINES] == ["engine", "config", "estimate"]
    assert b["long"]["kv_total_bytes"] == 4096 * 16 * bpt           # num_gpu_blocks × block_size
    assert b["short"]["kv_total_bytes"] == 60_000 * bpt
    # 25% in use (polled: a scrape late on a busy machine reports no free KV for a moment)
    gw.wait_until(lambda: gw.backend("short")["kv_free_bytes"] == 45_000 * bpt)
    assert b["plain"]["kv_total_bytes"] == perf_model.kv_capacity_bytes(model, load_catalog().gpu("L40S")) // bpt * bpt
    assert metric_total(gw, "heterogate_backend_max_model_len", backend="plain") == 40_000


def test_the_gateways_own_model_listing_gives_the_longest_context(cluster: Cluster) -> None:
    gw, _ = cluster
    (card,) = httpx.get(f"{gw.url}/v1/models", timeout=5).json()["data"]
    assert (card["id"], card["max_model_len"]) == (MODEL, 40_000)


def test_a_long_prompt_goes_only_to_backends_whose_context_fits(cluster: Cluster) -> None:
    gw, urls = cluster
    before = served(urls)
    for _ in range(4):   # above the catalog's 4,096 and short's 2,048: long or plain
        assert complete(gw, 10_000).status_code == 200
    for _ in range(3):   # above long's 32,768: only plain, by its configured context
        assert complete(gw, 34_000).status_code == 200
    after = served(urls)
    delta = {bid: after[bid] - before[bid] for bid in urls}
    assert delta["short"] == 0 and delta["plain"] >= 3 and delta["long"] + delta["plain"] == 7, delta


def test_no_backend_fits_is_400_naming_the_longest_context(cluster: Cluster) -> None:
    gw, _ = cluster
    err = assert_openai_error(complete(gw, 41_000), 400, type_="invalid_request_error", param="prompt",
                              code="context_length_exceeded")
    assert "40000" in err["message"]
    err = assert_openai_error(complete(gw, 30_000, max_tokens=16_000), 400, type_="invalid_request_error",
                              param="max_tokens", code="context_length_exceeded")
    assert "40000" in err["message"] and "46000" in err["message"]


def test_max_prompt_tokens_is_honoured(cluster: Cluster) -> None:
    gw, _ = cluster
    err = assert_openai_error(complete(gw, MAX_PROMPT_TOKENS + 1), 400, type_="invalid_request_error",
                              param="prompt", code="context_length_exceeded")
    assert str(MAX_PROMPT_TOKENS) in err["message"]


def test_an_unasked_max_tokens_fits_the_chosen_backend(cluster: Cluster) -> None:
    """Without max_tokens the default (256) is cut to the room left on the backend that takes it."""
    gw, urls = cluster
    assert complete(gw, 33_000, max_tokens=None).status_code == 200    # only plain: 40,000 − 33,000 left
    assert httpx.get(f"{urls['plain']}/stats", timeout=5).json()["max_tokens"][-1] == 256
    assert complete(gw, 39_900, max_tokens=None).status_code == 200    # 100 left
    assert httpx.get(f"{urls['plain']}/stats", timeout=5).json()["max_tokens"][-1] == 100
