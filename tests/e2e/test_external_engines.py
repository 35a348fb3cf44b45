"""Existing OpenAI-compatible engines (vLLM / SGLang formats) behind the gateway, with heartbeat agents.

Real processes on 127.0.0.1: two fake engines, one agent beside each, and the gateway.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson
import pytest

from common.catalog import load_catalog
from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config

MODEL = "llava-1.5-7b"
UPSTREAM_MODEL = "llava-hf/llava-1.5-7b-hf"   # what ext-vllm serves under
VLLM_CONTEXT = 32768                          # what ext-vllm lists in /v1/models
Agent = subprocess.Popen[bytes]
Cluster = tuple[Gateway, dict[str, str], list[Agent]]


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[str, str], list[Agent]]]:
    tmp: Path = tmp_path_factory.mktemp("external")
    engines = {"ext-vllm": ("vllm", free_port()), "ext-sglang": ("sglang", free_port())}
    urls = {bid: f"http://127.0.0.1:{port}" for bid, (_, port) in engines.items()}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "routing": {"policy": "shortest_queue"},
                    "retry_backoff_s": 0.001},
        "backends": [{"id": bid, "kind": "openai", "role": "language", "gpu": "A100-80GB", "address": urls[bid],
                      "agent": True, **({"upstream_model": UPSTREAM_MODEL} if bid == "ext-vllm" else {})}
                     for bid in engines],
    })
    with ExitStack() as stack:
        for engine, port in engines.values():
            context = ("--max-model-len", str(VLLM_CONTEXT)) if engine == "vllm" else ()
            proc = spawn("tests.fake_openai_server", "--port", str(port), "--engine", engine, *context)
            stack.callback(stop, proc)
        gw = stack.enter_context(run_gateway(config, healthy=0))
        agents = []
        for bid, (engine, _) in engines.items():
            agent = spawn("backends.agent", "--engine", engine, "--address", urls[bid], "--backend-id", bid,
                          "--gpu", "A100-80GB", "--model", MODEL, "--gateway", f"127.0.0.1:{gw.grpc_port}",
                          "--interval-ms", "100", "--kv-total-tokens", "100000")
            stack.callback(stop, agent)
            agents.append(agent)
        gw.wait_until(lambda: all(b["healthy"] for b in gw.backends()), timeout=30)
        yield gw, urls, agents


def control(url: str, **values: int) -> None:
    httpx.post(f"{url}/control", json=values, timeout=5).raise_for_status()


def served(url: str) -> int:
    return int(httpx.get(f"{url}/stats", timeout=5).json()["served"])


def chat(gw: Gateway, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)


def test_agent_metrics_move_routing(cluster: Cluster) -> None:
    gw, urls, _ = cluster
    for busy, idle in (("ext-vllm", "ext-sglang"), ("ext-sglang", "ext-vllm")):
        control(urls[busy], waiting=50)
        control(urls[idle], waiting=0)
        gw.wait_until(lambda b=busy, i=idle: gw.backend(b)["queue_depth"] >= 50 and gw.backend(i)["queue_depth"] < 50)
        picks = {chat(gw).headers["x-heterogate-backend"] for _ in range(5)}
        assert picks == {idle}
    control(urls["ext-sglang"], waiting=0)


def test_every_backend_saturated_the_request_waits_for_admission_until_its_deadline(cluster: Cluster) -> None:
    """Queue depth at the admission limit (256 by default) everywhere: the request is not dispatched, it
    waits in the admission queue and gets 504 deadline_exceeded at its own deadline (sooner than the
    queue's max_wait_s). One backend below the limit: served."""
    gw, urls, _ = cluster
    before = {bid: served(url) for bid, url in urls.items()}
    try:
        for url in urls.values():
            control(url, waiting=300)
        gw.wait_until(lambda: all(gw.backend(b)["queue_depth"] >= 300 for b in urls))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30, headers={"x-request-timeout": "1"})
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "deadline_exceeded" and "saturated" in resp.json()["error"]["message"]
        assert 0.9 < resp.elapsed.total_seconds() < 5
        assert {bid: served(url) for bid, url in urls.items()} == before   # nothing was dispatched
        control(urls["ext-sglang"], waiting=200)
        gw.wait_until(lambda: gw.backend("ext-sglang")["queue_depth"] < 256)
        resp = chat(gw)
        assert resp.status_code == 200 and resp.headers["x-heterogate-backend"] == "ext-sglang"
    finally:
        for url in urls.values():
            control(url, waiting=0)


def test_agents_report_context_and_kv_capacity_with_their_sources(cluster: Cluster) -> None:
    gw, _, _ = cluster
    b = {x["id"]: x for x in gw.backends()}
    assert (b["ext-vllm"]["max_model_len"], b["ext-vllm"]["context_source"]) == (VLLM_CONTEXT, "engine")
    assert (b["ext-sglang"]["max_model_len"], b["ext-sglang"]["context_source"]) == (4096, "catalog")
    # --kv-total-tokens 100000 fills in only where the engine's metrics give no capacity
    bpt = load_catalog().model(MODEL).kv_bytes_per_token
    assert b["ext-vllm"]["kv_total_bytes"] == 4096 * 16 * bpt
    assert (b["ext-vllm"]["kv_capacity_source"], b["ext-sglang"]["kv_capacity_source"]) == ("engine", "config")
    assert b["ext-sglang"]["kv_total_bytes"] == 100_000 * bpt
    # the KV block the engine's prefix cache counts in, from its cache_config_info (the SGLang one's has none)
    blocks = [b[x]["prefix_cache"]["engine_block_tokens"] for x in ("ext-vllm", "ext-sglang")]
    assert blocks == [16, None]
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 4 * 8000, "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200 and r.headers["x-heterogate-backend"] == "ext-vllm", r.text


def test_streaming_and_usage_pass_through(cluster: Cluster) -> None:
    gw, _, _ = cluster
    plain = chat(gw)
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 "
    assert plain.json()["usage"]["completion_tokens"] == 4
    events = [ln for ln in chat(gw, stream=True).text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 6


@pytest.mark.parametrize("upstream", ["ext-vllm", "ext-sglang"])
def test_streamed_events_are_relayed_with_the_gateways_id_and_model(cluster: Cluster, upstream: str) -> None:
    """The upstream's events pass through as they came (its extra fields too), one role event, our id."""
    gw, urls, _ = cluster
    other = "ext-sglang" if upstream == "ext-vllm" else "ext-vllm"
    control(urls[other], waiting=50)
    control(urls[upstream], waiting=0)
    gw.wait_until(lambda: gw.backend(other)["queue_depth"] >= 50 and gw.backend(upstream)["queue_depth"] < 50)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": "relay-1"}, timeout=30)
    assert resp.headers["x-heterogate-backend"] == upstream
    payloads = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    events = [orjson.loads(p) for p in payloads[:-1]]
    assert {e["id"] for e in events} == {"chatcmpl-relay-1"}
    assert {e["model"] for e in events} == {MODEL}   # never the upstream's own name
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and sum("role" in d for d in deltas) == 1
    assert "".join(d.get("content", "") for d in deltas) == "w0 w1 w2 "
    assert all(e.get("engine_marker") == 7 for e in events if e["choices"])   # relayed, not rebuilt
    assert events[-1]["usage"]["completion_tokens"] == 3
    control(urls[other], waiting=0)


@pytest.mark.parametrize("upstream", ["ext-vllm", "ext-sglang"])
def test_non_streamed_reply_is_the_upstreams_own(cluster: Cluster, upstream: str) -> None:
    """A non-streamed request is asked of the upstream non-streamed: its reply comes back whole (its extra
    fields, tool_calls and logprobs keys too), with the gateway's id and model."""
    gw, urls, _ = cluster
    other = "ext-sglang" if upstream == "ext-vllm" else "ext-vllm"
    control(urls[other], waiting=50)
    control(urls[upstream], waiting=0)
    gw.wait_until(lambda: gw.backend(other)["queue_depth"] >= 50 and gw.backend(upstream)["queue_depth"] < 50)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": "whole-1"}, timeout=30)
    assert resp.status_code == 200 and resp.headers["x-heterogate-backend"] == upstream
    reply = resp.json()
    assert (reply["id"], reply["model"], reply["engine_marker"]) == ("chatcmpl-whole-1", MODEL, 7)
    choice = reply["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "w0 w1 w2 ", "tool_calls": []}
    assert "logprobs" in choice and reply["usage"]["completion_tokens"] == 3
    control(urls[other], waiting=0)


def test_request_deadline_bounds_a_stream_that_stalls_after_its_first_token(cluster: Cluster) -> None:
    """The upstream keeps sending, slowly: each read is quick, the whole would take 20 s; the client
    gave 1.5 s. The stream must end with an error event at the deadline, and the gateway keeps serving."""
    gw, urls, _ = cluster
    for url in urls.values():
        control(url, token_delay_ms=500)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"x-request-timeout": "1.5"}) as resp:
            assert resp.status_code == 200
            payloads = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    finally:
        for url in urls.values():
            control(url, token_delay_ms=1)
    assert payloads[-1] == "[DONE]"
    error = orjson.loads(payloads[-2])["error"]
    assert error["code"] == "deadline_exceeded" and "deadline" in error["message"]   # the client's own
    assert sum(1 for p in payloads if '"w' in p) < 10
    assert chat(gw).status_code == 200


def test_request_deadline_bounds_a_whole_reply_that_comes_too_slowly(cluster: Cluster) -> None:
    """Non-streamed, the upstream would take 20 s for its reply; the client gave 1.5 s: a 504 in the
    OpenAI error shape at about the deadline, and the gateway keeps serving."""
    gw, urls, _ = cluster
    for url in urls.values():
        control(url, token_delay_ms=500)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
        resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"x-request-timeout": "1.5"})
    finally:
        for url in urls.values():
            control(url, token_delay_ms=1)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "deadline_exceeded"
    assert resp.elapsed.total_seconds() < 5
    assert chat(gw).status_code == 200


def test_upstream_5xx_is_retried_once_elsewhere_without_duplicates(cluster: Cluster) -> None:
    gw, urls, _ = cluster
    control(urls["ext-vllm"], waiting=0, fail=1)
    control(urls["ext-sglang"], waiting=10)
    gw.wait_until(lambda: gw.backend("ext-sglang")["queue_depth"] >= 10 and gw.backend("ext-vllm")["queue_depth"] < 10)
    before = {bid: served(url) for bid, url in urls.items()}
    resp = chat(gw)
    assert resp.status_code == 200 and resp.headers["x-heterogate-backend"] == "ext-sglang"
    after = {bid: served(url) for bid, url in urls.items()}
    assert after["ext-sglang"] - before["ext-sglang"] == 1 and after["ext-vllm"] == before["ext-vllm"]
    control(urls["ext-sglang"], waiting=0)


def test_all_stale_fails_open_and_says_so(cluster: Cluster) -> None:
    """Runs last in the module: it stops the agents."""
    gw, urls, agents = cluster
    for agent in agents:
        stop(agent)
    gw.wait_until(lambda: not any(b["healthy"] for b in gw.backends()))
    assert chat(gw).status_code == 200
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert "heterogate_routing_failing_open 1.0" in metrics
    assert sum(served(url) for url in urls.values()) > 0

