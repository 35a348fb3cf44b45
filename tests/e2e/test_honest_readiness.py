"""`kind: openai` backends whose signals fail, from a real gateway in front of the fake OpenAI server
(tests/fake_openai_server.py) on 127.0.0.1: metrics that go stale while the upstream answers fail open
(served on the gateway's own in-flight counts, `heterogate_routing_failing_open` 1, still ready); an
upstream that stops answering, or was never there, is no candidate: requests get 503 at once, not an
admission wait, and /ready says 503 (to HEAD as to GET)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import Gateway, free_port, metric_total, run_gateway, sigstopped, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"
pytestmark = pytest.mark.timeout(180)
# The request's own deadline: an admission wait on a backend that looks saturated would end in a 429
# after it, where the gateway should answer at once.
DEADLINE = {"x-request-timeout": "5"}


def config(tmp: Path, address: str, scrape: bool) -> Path:
    backend: dict[str, Any] = {"id": "up", "kind": "openai", "gpu": "L40S", "address": address}
    if scrape:
        backend["scrape"] = {"engine": "vllm", "interval_ms": 100}
    return write_config(tmp, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100}, "backends": [backend]})


@contextmanager
def scraped_upstream(tmp: Path) -> Iterator[tuple[Gateway, str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    try:
        with run_gateway(config(tmp, url, scrape=True), healthy=1, timeout=60) as gw:
            yield gw, url, upstream
    finally:
        stop(upstream)


def chat(gw: Gateway) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=DEADLINE, timeout=30)


def ready(gw: Gateway, method: str = "GET") -> httpx.Response:
    return httpx.request(method, f"{gw.url}/ready", timeout=5)


def test_metrics_failing_while_the_upstream_answers_fails_open(tmp_path: Path) -> None:
    with scraped_upstream(tmp_path) as (gw, url, _):
        assert chat(gw).status_code == 200
        assert metric_total(gw, "heterogate_routing_failing_open") == 0
        httpx.post(f"{url}/control", json={"metrics_status": 500}, timeout=5).raise_for_status()
        gw.wait_until(lambda: not gw.backend("up")["healthy"])   # its metrics went stale
        resp = chat(gw)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-heterogate-backend"] == "up"
        assert metric_total(gw, "heterogate_routing_failing_open") == 1
        assert gw.backend("up")["reachable"] is True
        assert gw.backend("up")["state"] == "reachable"   # it serves: not shown as down
        assert ready(gw).status_code == 200 and ready(gw, "HEAD").status_code == 200
        httpx.post(f"{url}/control", json={"metrics_status": 200}, timeout=5).raise_for_status()
        gw.wait_until(lambda: gw.backend("up")["healthy"])
        assert chat(gw).status_code == 200 and gw.backend("up")["state"] == "healthy"
        assert metric_total(gw, "heterogate_routing_failing_open") == 0


def test_an_upstream_that_stops_fails_requests_at_once_and_is_not_ready(tmp_path: Path) -> None:
    with scraped_upstream(tmp_path) as (gw, _, upstream):
        assert chat(gw).status_code == 200 and ready(gw).status_code == 200
        stop(upstream)
        gw.wait_until(lambda: gw.backend("up").get("reachable") is False)
        assert gw.backend("up")["state"] == "unhealthy"
        resp = chat(gw)
        assert resp.status_code == 503, resp.text   # not a 429 after the request's deadline
        assert resp.json()["error"]["code"] != "overloaded"
        assert ready(gw).status_code == 503 and ready(gw, "HEAD").status_code == 503
        assert ready(gw).json()["healthy_language_backends"] == 0


@pytest.mark.parametrize("scrape", [False, True], ids=["probe-only", "scraped"])
def test_nothing_listening_is_not_ready_and_fails_at_once(tmp_path: Path, scrape: bool) -> None:
    with run_gateway(config(tmp_path, f"http://127.0.0.1:{free_port()}", scrape), healthy=0, timeout=60) as gw:
        gw.wait_until(lambda: gw.backend("up").get("reachable") is False)
        assert ready(gw).status_code == 503 and ready(gw).json()["healthy_language_backends"] == 0
        resp = chat(gw)
        assert resp.status_code == 503, resp.text
        assert httpx.head(f"{gw.url}/health", timeout=5).status_code == 200   # the process itself is fine


def test_an_upstream_that_refuses_the_gateways_key_is_not_ready_and_says_why(tmp_path: Path) -> None:
    """A wrong api_key: the upstream answers every request 401. Its probe (sent with the key) says so:
    no candidate, /ready 503, and last_error names the key, where it was counted as up and ready."""
    port = free_port()
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--api-key", "right-key")
    path = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100}, "backends": [
        {"id": "up", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{port}", "api_key": "wrong-key"}]})
    try:
        with run_gateway(path, healthy=0, timeout=60) as gw:
            gw.wait_until(lambda: gw.backend("up").get("reachable") is False, timeout=30)
            described = gw.backend("up")
            assert described["state"] == "unhealthy" and "HTTP 401" in described["last_error"]
            assert "api_key" in described["last_error"]
            assert ready(gw).status_code == 503
            assert chat(gw).status_code == 503
    finally:
        stop(upstream)


def upstream_beside_an_engine(tmp: Path, port: int, **gateway: Any) -> Path:
    """The fake upstream on `port` (scraped) beside a simulated engine, taken in turn."""
    return write_config(tmp, {"model": MODEL, "gateway": {
        "heartbeat_interval_ms": 100, "retry_backoff_s": 0.001, "routing": {"policy": "round_robin"}, **gateway},
        "backends": [{"id": "up", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{port}",
                      "scrape": {"engine": "vllm", "interval_ms": 100}},
                     {"id": "sim", "gpu": "H100", "launch": {"time_scale": 0.05}}]})


def test_non_streamed_requests_on_an_upstream_that_hangs_are_retried_once_it_is_found_unreachable(
    tmp_path: Path,
) -> None:
    """The upstream stops (SIGSTOP) with non-streamed requests on it: once the gateway's probe finds it
    unreachable they are retried on the other backend, where before they waited for a reply that comes
    whole (no first-token limit) until the upstream died or request_timeout_s (10 minutes)."""
    port = free_port()
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    path = upstream_beside_an_engine(tmp_path, port)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with run_gateway(path, "--log-level", "info", healthy=2, timeout=60) as gw:
            assert {chat(gw).headers["x-heterogate-backend"] for _ in range(4)} == {"up", "sim"}
            # a reply of 2 tokens now takes the upstream 4 s: the requests are on it when it stops
            httpx.post(f"http://127.0.0.1:{port}/control", json={"token_delay_ms": 2000}, timeout=5).raise_for_status()
            with ThreadPoolExecutor(4) as pool:
                sent = [pool.submit(httpx.post, f"{gw.url}/v1/chat/completions", json=body, timeout=60)
                        for _ in range(4)]
                gw.wait_until(lambda: gw.backend("up")["in_flight"] > 0)
                with sigstopped(upstream.pid):
                    replies = [f.result() for f in sent]
            assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
            assert {r.headers["x-heterogate-backend"] for r in replies} == {"sim"}
            assert "its upstream stopped answering the gateway's probe" in gw.log_path.read_text()
    finally:
        stop(upstream)


def test_non_streamed_requests_an_upstream_takes_and_never_answers_are_retried_at_their_reply_limit(
    tmp_path: Path,
) -> None:
    """The upstream keeps answering its probe and metrics but holds every completion (a wedged engine
    behind a live server): a non-streamed request on it goes to the other backend at its reply limit
    (first_token_timeout_s + factor x max_tokens x decode step, about 1 s here), where before it waited
    for request_timeout_s."""
    port = free_port()
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    path = upstream_beside_an_engine(tmp_path, port, limits={"first_token_timeout_s": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with run_gateway(path, "--log-level", "info", healthy=2, timeout=60) as gw:
            assert {chat(gw).headers["x-heterogate-backend"] for _ in range(4)} == {"up", "sim"}
            # a reply of 2 tokens now takes the upstream 20 minutes; its probe and metrics still answer
            httpx.post(f"http://127.0.0.1:{port}/control", json={"token_delay_ms": 600_000},
                       timeout=5).raise_for_status()
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda _: httpx.post(f"{gw.url}/v1/chat/completions", json=body,
                                                             timeout=30), range(4)))
            assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
            assert {r.headers["x-heterogate-backend"] for r in replies} == {"sim"}
            assert gw.backend("up")["reachable"] is not False
            assert "(its reply limit)" in gw.log_path.read_text()
    finally:
        stop(upstream)
