"""A gateway subscribed to its upstreams' KV cache events: two demo upstreams that cache prompts of token
ids and publish their events over ZeroMQ as vLLM does (`--kv-events-endpoint`), on 127.0.0.1. A prompt
another client sent straight to one of them (never routed by the gateway) is then routed there through
the gateway, and a reset of that engine's prefix cache empties the gateway's view of it. With the
model's tokenizer (`tokenizer:`), a chat the gateway renders and tokenizes as the engine would finds
the blocks the engine stored for those ids. Engines with replay sockets (`--kv-replay-endpoint`) tell a
gateway started after them what they cached before."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, free_port, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"
pytestmark = pytest.mark.timeout(180)
IDS = ("up-a", "up-b")


@contextmanager
def two_upstreams(tmp: Path, *, replay: bool = False, before: Callable[[dict[str, str]], None] | None = None,
                  **top: object) -> Iterator[tuple[Gateway, dict[str, str]]]:
    """Two demo upstreams publishing KV events (`replay`: with replay sockets, named on their entries),
    then the gateway; `before` is called with their URLs once they answer, before the gateway starts."""
    ports = {bid: free_port() for bid in IDS}
    events = {bid: {"endpoint": f"tcp://127.0.0.1:{free_port()}"} for bid in IDS}
    if replay:
        for spec in events.values():
            spec["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    upstreams = [spawn("tests.fake_openai_server", "--port", str(ports[bid]), "--engine", "vllm",
                       "--kv-events-endpoint", events[bid]["endpoint"],
                       *(("--kv-replay-endpoint", events[bid]["replay_endpoint"]) if replay else ()))
                 for bid in IDS]
    urls = {bid: f"http://127.0.0.1:{ports[bid]}" for bid in IDS}
    path = write_config(tmp, {"model": MODEL, **top, "gateway": {"heartbeat_interval_ms": 100}, "backends": [
        {"id": bid, "kind": "openai", "gpu": "H100", "address": urls[bid], "scrape": {"engine": "vllm"},
         "kv_events": events[bid]} for bid in IDS]})
    try:
        if before is not None:
            for url in urls.values():
                answering(url)
            before(urls)
        with run_gateway(path, healthy=2, timeout=60) as gw:
            yield gw, urls
    finally:
        for upstream in upstreams:
            stop(upstream)


def answering(url: str) -> None:
    """Until the upstream answers (at most 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not start"
        time.sleep(0.1)


def prompt(seed: int, n: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def complete(url: str, ids: list[int]) -> httpx.Response:
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def events_of(gw: Gateway, backend_id: str) -> dict[str, int]:
    return gw.backend(backend_id)["prefix_cache"]["events"] or {}


def subscribed(gw: Gateway, urls: dict[str, str]) -> None:
    """Once the gateway hears each engine's events (ZeroMQ subscriptions take a moment: the engines'
    first batches may go unheard)."""
    seed = 1000
    for bid in IDS:
        def heard(bid: str = bid) -> bool:
            nonlocal seed
            seed += 1
            complete(urls[bid], prompt(seed, 64))
            return events_of(gw, bid).get("stored_blocks", 0) > 0
        gw.wait_until(heard, timeout=20)


def test_prompts_another_client_cached_on_an_upstream_are_routed_there(tmp_path: Path) -> None:
    with two_upstreams(tmp_path) as (gw, urls):
        subscribed(gw, urls)
        for k in range(6):
            target = IDS[k % 2]
            ids = prompt(k)
            stored = events_of(gw, target)["stored_blocks"]
            complete(urls[target], ids)   # straight to the engine, as another client would
            gw.wait_until(lambda t=target, s=stored: events_of(gw, t)["stored_blocks"] >= s + 32)
            via = complete(gw.url, ids + prompt(100 + k, 64))
            assert via.headers["x-heterogate-backend"] == target, k
            assert via.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        described = gw.backend("up-a")["prefix_cache"]
        assert described["source"] == "events" and described["blocks"] > 0
        assert "heterogate_prefix_index_source{backend=\"up-a\",source=\"events\"} 1.0" in httpx.get(
            f"{gw.url}/metrics", timeout=10).text
        # vLLM's POST /reset_prefix_cache: AllBlocksCleared, and the gateway's view of up-a is empty
        httpx.post(f"{urls['up-a']}/reset_prefix_cache", timeout=10).raise_for_status()
        gw.wait_until(lambda: gw.backend("up-a")["prefix_cache"]["blocks"] == 0)
        assert events_of(gw, "up-a")["cleared"] == 1
        assert gw.backend("up-b")["prefix_cache"]["blocks"] > 0


def test_a_gateway_started_after_its_engines_cached_prompts_learns_them_from_their_replay_sockets(
    tmp_path: Path,
) -> None:
    """Prompts the engines cached before the gateway started (another client's, or before a restart):
    on subscribing, the gateway asks each engine's replay socket for the batches it holds, and those
    prompts are routed where they are cached (without the replay socket, a draw)."""
    early = [prompt(200 + k) for k in range(6)]

    def cache_early(urls: dict[str, str]) -> None:
        for k, ids in enumerate(early):
            complete(urls[IDS[k % 2]], ids)

    with two_upstreams(tmp_path, replay=True, before=cache_early) as (gw, urls):
        subscribed(gw, urls)
        for k, ids in enumerate(early):
            via = complete(gw.url, ids + prompt(300 + k, 64))
            assert via.headers["x-heterogate-backend"] == IDS[k % 2], k
            assert via.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        for bid in IDS:
            assert events_of(gw, bid)["replayed_batches"] >= 3 and events_of(gw, bid)["lost_batches"] == 0


def test_a_chat_tokenized_at_the_gateway_finds_what_the_engine_stored_for_its_ids(tmp_path: Path) -> None:
    from common.tokenizer import byte_tokenizer, encode_chat, load_tokenizer

    folder = tmp_path / "tokenizer"
    byte_tokenizer("llava").save_pretrained(folder)
    tok = load_tokenizer(str(folder))
    with two_upstreams(tmp_path, tokenizer=str(folder)) as (gw, urls):
        subscribed(gw, urls)
        for k in range(4):
            target = IDS[k % 2]
            text = " ".join(f"turn {k} word {i}" for i in range(120))
            ids = encode_chat(tok, [{"role": "user", "content": text}], []).ids   # as the engine renders it
            expected = events_of(gw, target)["stored_blocks"] + len(ids) // 16
            complete(urls[target], ids)
            gw.wait_until(lambda t=target, s=expected: events_of(gw, t)["stored_blocks"] >= s)
            resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-heterogate-backend"] == target, k
            assert resp.json()["usage"]["prompt_tokens"] > 0
        # a prompt the tokenizer refuses (an image placeholder with no image) is the upstream's to judge
        resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "what is <image>?"}], "max_tokens": 1})
        assert resp.status_code == 200, resp.text
