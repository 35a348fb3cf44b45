"""Cache-aware routing end to end: a gateway and two simulated engines with prefix caches.

A conversation's next turn lands where its prefix is cached, by its blocks or by its session, unless
that backend is overloaded: a burst of turns that share a cached prefix fills that backend's KV, and
the rest go to the other one. /admin/backends and /metrics show the index's source and predicted vs
reported hits. A gateway in front of a cold engine keeps predicting after the engine's first misses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from testkit.harness import (
    Gateway,
    data_url,
    image_bytes,
    image_part,
    long_request_id,
    metric_total,
    run_gateway,
    text_part,
    write_config,
)

MODEL = "llava-1.5-7b"
BACKENDS = ("a100-a", "a100-b")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # memory_utilization 0.25: about 11,200 KV tokens an engine, three requests of 3,600 tokens
    launch = {"time_scale": 1.0, "memory_utilization": 0.25}
    config = write_config(tmp_path_factory.mktemp("cache_aware"), {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": b, "role": "language", "gpu": "A100-80GB", "launch": launch} for b in BACKENDS],
    })
    with run_gateway(config, "--log-level", "info") as gateway:
        yield gateway


def system_prompt(name: str) -> str:
    """About 2,000 tokens (8,000 bytes) of a tenant's instructions."""
    return "".join(f"{name} rule {k:04d}: answer briefly and cite the policy. " for k in range(160))[:8000]


def chat(gw: Gateway, messages: list[dict[str, str]], *, max_tokens: int = 4, headers: dict[str, str] | None = None,
         body: dict[str, Any] | None = None) -> httpx.Response:
    payload = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **(body or {})}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=payload, headers=headers or {}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def lasting(name: str) -> dict[str, Any]:
    """chat() arguments for a request that generates 200 tokens or more (seconds): concurrent ones
    overlap, so the router spreads them whatever the machine's load."""
    return {"max_tokens": 300, "headers": {"x-request-id": long_request_id(200, prefix=name)}}


def backend_of(resp: httpx.Response) -> str:
    return resp.headers["x-heterogate-backend"]


def turn(history: list[dict[str, str]], question: str) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": question}]


def test_each_conversations_second_turn_lands_where_its_first_turn_went(gw: Gateway) -> None:
    conversations = [[{"role": "system", "content": system_prompt(f"tenant{k}")}] for k in range(6)]
    firsts = [turn(c, "What is the refund window?") for c in conversations]
    with ThreadPoolExecutor(len(firsts)) as pool:   # at once, for seconds each: spread over both backends
        replies = list(pool.map(lambda k: chat(gw, firsts[k], **lasting(f"first-{k}")), range(len(firsts))))
    first_backends = [backend_of(r) for r in replies]
    assert set(first_backends) == set(BACKENDS), first_backends
    for messages, reply, backend in zip(firsts, replies, first_backends, strict=True):
        answer = reply.json()["choices"][0]["message"]["content"]
        second = turn([*messages, {"role": "assistant", "content": answer}], "And for digital goods?")
        assert backend_of(chat(gw, second)) == backend   # idle both: the cached prefix decides

    described = {b["id"]: b["prefix_cache"] for b in gw.backends()}
    for backend in BACKENDS:
        cache = described[backend]
        assert cache["source"] == "engine"   # the simulated engines report vLLM's counters in heartbeats
        assert cache["engine_block_tokens"] == 16   # and their KV block, which hits are counted in
        assert cache["predicted_hit_tokens"] > 0 and cache["reported_hit_tokens"] > 0
        assert 0 < cache["predicted_hit_rate"] < 1 and 0 < cache["reported_hit_rate"] < 1
    assert metric_total(gw, "heterogate_prefix_predicted_hit_tokens_total") > 0
    assert metric_total(gw, "heterogate_prefix_index_source", source="engine") == len(BACKENDS)


def test_usage_says_how_much_of_the_prompt_the_engine_found_cached(gw: Gateway) -> None:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`, from the engine, streamed or not; the
    request's log line has it beside the index's prediction for the backend it went to."""
    history = [{"role": "system", "content": system_prompt("usage")}]
    first = chat(gw, turn(history, "First question?"), headers={"x-request-id": "usage-first"}).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] < 500   # a system prompt not seen before
    body = {"model": MODEL, "messages": turn(history, "Second question?"), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": "usage-second"},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    events = [orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    second = events[-1]["usage"]
    assert 1_500 <= second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"], second

    def line(rid: str) -> dict[str, Any] | None:
        found = gw.log_records()
        return next((f for f in found if f.get("event") == "request" and f.get("request_id") == rid), None)

    logged = gw.wait_until(lambda: line("usage-second"), timeout=10)
    assert logged["cached_tokens"] == second["prompt_tokens_details"]["cached_tokens"]
    assert logged["predicted_cached_tokens"] >= 1_500


def test_a_named_session_sticks_even_when_its_text_changes(gw: Gateway) -> None:
    def opening(session: dict[str, Any]) -> str:
        both = lasting(f"opening-{session}")
        both["headers"] |= session.get("headers", {})
        return backend_of(chat(gw, [{"role": "user", "content": f"opening of {session} " * 100}],
                               body=session.get("body"), **both))

    # by header and by the body's `user`; two sessions at once, until their homes differ (near-equal costs are
    # drawn at random, so two idle openings may share a backend)
    for kind in range(2):
        for attempt in range(8):
            sessions = ([{"headers": {"x-session-id": f"s-{attempt}-{k}"}} for k in (1, 2)] if kind == 0 else
                        [{"body": {"user": f"u-{attempt}-{k}"}} for k in (1, 2)])
            with ThreadPoolExecutor(2) as pool:
                homes = list(pool.map(opening, sessions))
            if set(homes) == set(BACKENDS):
                break
        assert set(homes) == set(BACKENDS), homes
        for session, home in zip(sessions, homes, strict=True):
            # no block in common with its opening: only the session can say where it was
            rewritten = [{"role": "user", "content": f"a summary of {session}'s earlier turns " * 20}]
            assert backend_of(chat(gw, rewritten, **session)) == home
    bad = httpx.post(f"{gw.url}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "user": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "user"


def test_affinity_gives_way_when_the_cached_backend_is_overloaded(gw: Gateway) -> None:
    history = [{"role": "system", "content": system_prompt("hot")}]
    home = backend_of(chat(gw, turn(history, "Warm the cache.")))
    assert backend_of(chat(gw, turn(history, "Still idle: the same backend?"))) == home

    def long_turn(k: int) -> tuple[str, httpx.Response]:
        """A turn that shares the hot prefix and generates for seconds (KV held: prompt + 1,500)."""
        rid = long_request_id(200, prefix=f"hot-{k}")
        resp = chat(gw, turn(history, f"Question {k}: explain at length."), max_tokens=1500,
                    headers={"x-request-id": rid})
        return rid, resp

    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(long_turn, range(8)))
    backends = [backend_of(resp) for _, resp in burst]
    assert backends.count(home) >= 1            # the cached backend takes what its KV holds ...
    assert len(set(backends)) == 2, backends    # ... and the rest recompute the prefix elsewhere


@pytest.fixture(scope="module")
def cold_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = write_config(tmp_path_factory.mktemp("cold_cache"), {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": "a100-a", "role": "language", "gpu": "A100-80GB", "launch": {"time_scale": 1.0}}],
    })
    with run_gateway(config) as gateway:
        yield gateway


def test_a_cold_engines_first_misses_do_not_turn_the_index_off(cold_gw: Gateway) -> None:
    """An engine that has cached nothing yet misses every new prompt: its first thousands of query
    tokens with no hit must not read as "this engine caches nothing" (keep_i 0, no prediction), which
    left the index predicting nothing there until its LRU regrew reading by reading."""
    gap = 0.35   # a few heartbeats (100 ms): each routing reads the engine's counters as last reported
    chat(cold_gw, [{"role": "user", "content": "hello"}])   # the index's first reading of the counters
    prompts = [turn([{"role": "system", "content": system_prompt(f"cold{k}")}], "Hi.") for k in range(4)]
    for messages in prompts:   # four new prompts of ~2,000 tokens: misses, nobody predicted a hit
        time.sleep(gap)
        chat(cold_gw, messages)
    time.sleep(gap)
    chat(cold_gw, turn(prompts[0][:1], "Again, and longer?"))   # a reading after them; a predicted hit
    cache = cold_gw.backend("a100-a")["prefix_cache"]
    assert cache["source"] == "engine" and cache["reported_query_tokens"] >= 4096
    assert cache["keep"] == 1.0 and cache["capacity_blocks"] > 0
    assert cache["predicted_hit_tokens"] > 0


@pytest.fixture(scope="module")
def monolithic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One engine that encodes its own images (role both): what it caches is what the test reads."""
    config = write_config(tmp_path_factory.mktemp("image_places"), {
        "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
        "backends": [{"id": "h100-both", "role": "both", "gpu": "H100", "launch": {}}]})
    with run_gateway(config) as gateway:
        yield gateway


def test_a_system_prompt_ahead_of_different_images_is_a_shared_prefix(monolithic: Gateway) -> None:
    """The engine lays out a prompt with each image where the chat puts it, and so does the index: a
    tenant's system prompt before another image is a hit for its full blocks, on both counts. With the
    images placed first, neither counted any of it."""
    system = {"role": "system", "content": system_prompt("vision-tenant")}   # 8,000 bytes: ~2,000 tokens

    def ask(seed: int) -> None:
        picture = image_part(data_url(image_bytes("PNG", (48, 48), noise=True, seed=seed)))
        chat(monolithic, [system, {"role": "user", "content": [picture, text_part("What is in it?")]}])

    def counts() -> tuple[int, int]:
        cache = monolithic.backend("h100-both")["prefix_cache"]
        return cache["predicted_hit_tokens"], cache["reported_hit_tokens"]

    def queries() -> int:
        return int(monolithic.backend("h100-both")["prefix_cache"]["reported_query_tokens"])

    chat(monolithic, [{"role": "user", "content": "hello"}])
    monolithic.wait_until(lambda: queries() > 0)   # the engine's counters read, hello's query in them
    hello = queries()
    ask(1)
    monolithic.wait_until(lambda: queries() > hello)
    before = counts()
    ask(2)   # another image after the same system prompt
    monolithic.wait_until(lambda: counts()[1] > before[1])
    predicted, reported = (now - then for now, then in zip(counts(), before, strict=True))
    # "system: " and the prompt's 8,000 bytes, in whole blocks: the index's of 64 tokens (256 bytes),
    # the engine's of 16 (64 bytes); the rest of the last one goes with the image
    assert predicted == (8 + 8000) // 256 * 64
    assert reported == (8 + 8000) // 64 * 16


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Two tenants whose prefixes are kept apart (tenants.isolate_prefix_cache), one engine."""
    tmp = tmp_path_factory.mktemp("isolated")
    for name in ("alpha", "beta", "admin"):
        (tmp / f"{name}.keys").write_text(f"sk-{name}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
                    "auth": {"admin_keys_file": str(tmp / "admin.keys"),
                             "cluster_token_file": str(tmp / "cluster.token")},
                    "tenants": {"isolate_prefix_cache": True, "teams": {
                        "alpha": {"api_keys_file": str(tmp / "alpha.keys")},
                        "beta": {"api_keys_file": str(tmp / "beta.keys")}}}},
        "backends": [{"id": "a100-a", "role": "language", "gpu": "A100-80GB", "launch": {}},
                     {"id": "l4-v", "role": "vision", "gpu": "L4", "launch": {}}]})
    with run_gateway(config, admin_key="sk-admin") as gateway:
        yield gateway


def test_isolated_tenants_share_no_cached_image_embedding(isolated: Gateway) -> None:
    """The vision engine's embedding cache keys an image under its request's salt: the tenant that sent it
    before finds it cached, another tenant's same image is encoded again."""
    picture = image_part(data_url(image_bytes("PNG", (48, 48), noise=True, seed=11)))

    def send(tenant: str) -> tuple[int, int]:
        before = isolated.backend("l4-v")
        chat(isolated, [{"role": "user", "content": [picture, text_part("What is it?")]}],
             headers={"authorization": f"Bearer sk-{tenant}"})
        isolated.wait_until(lambda: isolated.backend("l4-v")["images_encoded"] + isolated.backend("l4-v")[
            "embedding_cache_hits"] > before["images_encoded"] + before["embedding_cache_hits"])
        after = isolated.backend("l4-v")
        return (after["images_encoded"] - before["images_encoded"],
                after["embedding_cache_hits"] - before["embedding_cache_hits"])

    assert send("alpha") == (1, 0)
    assert send("alpha") == (0, 1)
    assert send("beta") == (1, 0)
    # a vision backend that takes no language work has no prompt prefix index (it showed an empty one)
    assert isolated.backend("l4-v")["prefix_cache"] is None
    assert 'backend="l4-v"' not in "".join(line for line in httpx.get(
        f"{isolated.url}/metrics", headers=isolated.admin_headers, timeout=5).text.splitlines()
        if line.startswith("heterogate_prefix_"))


def test_isolated_tenants_share_no_cached_prefix(isolated: Gateway) -> None:
    """The same system prompt is a hit for the tenant that sent it before, on the engine and in the index,
    and no hit for another tenant, neither by its blocks nor by the session name both use; the other
    tenant's second request hits its own."""
    system = {"role": "system", "content": system_prompt("shared")}

    def ask(tenant: str, question: str) -> tuple[int, int]:
        before = counts()
        key = {"authorization": f"Bearer sk-{tenant}", "x-session-id": "support-chat"}   # one name, two tenants
        chat(isolated, [system, {"role": "user", "content": question}], headers=key)
        isolated.wait_until(lambda: counts()[2] > before[2])   # the engine reported this request's query
        after = counts()
        return after[0] - before[0], after[1] - before[1]

    def counts() -> tuple[int, int, int]:
        cache = isolated.backend("a100-a")["prefix_cache"]
        return cache["predicted_hit_tokens"], cache["reported_hit_tokens"], cache["reported_query_tokens"]

    chat(isolated, [{"role": "user", "content": "hello"}], headers={"authorization": "Bearer sk-alpha"})
    isolated.wait_until(lambda: counts()[2] > 0)   # the engine's counters read, hello's query in them
    assert ask("alpha", "What is the refund window?") == (0, 0)
    alpha_again = ask("alpha", "And the exchange window?")
    beta_first = ask("beta", "What is the refund window?")
    beta_again = ask("beta", "And the exchange window?")
    assert min(alpha_again) > 1000 and min(beta_again) > 1000   # ~2,000 tokens of system prompt
    assert beta_first == (0, 0)
