"""One deadline bounds the whole request, retries included: an upstream that fails slowly (or hangs)
cannot make a request outlive it, no attempt starts after it, and the request's log line says how
many attempts it took and on which backends.

Real processes on 127.0.0.1: one fake OpenAI-compatible upstream behind four `kind: openai` entries.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config

MODEL = "llava-1.5-7b"
BACKENDS = ["up-a", "up-b", "up-c", "up-d"]
Cluster = tuple[Gateway, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp: Path = tmp_path_factory.mktemp("deadlines")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    upstream = subprocess.Popen([sys.executable, "-m", "tests.fake_openai_server", "--port", str(port)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"retry_backoff_s": 0.001, "limits": {"max_attempts": len(BACKENDS)},
                    "breaker": {"failure_threshold": 1000}},
        "backends": [{"id": b, "kind": "openai", "gpu": "A100-80GB", "address": url} for b in BACKENDS],
    })
    try:
        with run_gateway(config, "--log-level", "info", healthy=0) as gw:
            gw.wait_until(lambda: _up(url), timeout=30)
            yield gw, url
    finally:
        upstream.kill()   # a graceful stop would wait for the hung handlers
        upstream.wait(timeout=10)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/stats", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def control(url: str, **values: Any) -> None:
    httpx.post(f"{url}/control", json=values, timeout=5).raise_for_status()


def arrivals(url: str) -> list[float]:
    return list(httpx.get(f"{url}/stats", timeout=5).json()["arrivals"])


def request_line(gw: Gateway, request_id: str) -> dict[str, Any]:
    """The gateway's one log line for the request (waits for it: it is written as the reply leaves)."""
    def find() -> dict[str, Any] | None:
        lines = gw.log_records()
        found = [ln for ln in lines if ln.get("event") == "request" and ln.get("request_id") == request_id]
        assert len(found) <= 1, found
        return found[0] if found else None
    return dict(gw.wait_until(find, timeout=10))


def chat(gw: Gateway, request_id: str, timeout_s: float, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    headers = {"x-request-timeout": str(timeout_s), "x-request-id": request_id}
    # The client waits far longer than the deadline: an answer at all shows the gateway kept it.
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_slow_failures_stop_at_the_deadline(cluster: Cluster) -> None:
    gw, url = cluster
    deadline_s, fail_delay_s = 1.5, 0.6
    before = len(arrivals(url))
    control(url, fail=100, fail_delay_ms=int(fail_delay_s * 1000))
    try:
        resp = chat(gw, "slow-fail", deadline_s)
    finally:
        control(url, fail=0, fail_delay_ms=0)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "deadline_exceeded"
    tried = arrivals(url)[before:]
    # Each failed attempt held the request for fail_delay_s: more attempts than fit in the deadline
    # would mean one started after it. Four backends were there to try.
    assert 1 <= len(tried) <= math.ceil(deadline_s / fail_delay_s) < len(BACKENDS)
    line = request_line(gw, "slow-fail")
    assert line["status"] == 504 and line["attempts"] == len(tried)
    assert len(line["backends"]) == len(tried) and set(line["backends"]) <= set(BACKENDS)
    assert line["latency_s"] > 0 and "deadline" in line["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_hanging_upstream_is_cut_at_the_deadline(cluster: Cluster, stream: bool) -> None:
    gw, url = cluster
    rid = f"hang-{int(stream)}"
    control(url, fail=1, fail_delay_ms=120_000)   # the first attempt hangs for two minutes
    try:
        resp = chat(gw, rid, 1.0, stream=stream)
    finally:
        control(url, fail=0, fail_delay_ms=0)
    assert resp.status_code == 504, resp.text
    line = request_line(gw, rid)
    assert line["status"] == 504 and line["attempts"] >= 1


def test_served_request_logs_attempts_and_tokens(cluster: Cluster) -> None:
    gw, url = cluster
    control(url, fail=1, fail_delay_ms=0)   # one quick failure, then served by another backend
    resp = chat(gw, "retried-ok", 30)
    assert resp.status_code == 200, resp.text
    line = request_line(gw, "retried-ok")
    assert line["status"] == 200 and line["attempts"] == 2 and len(set(line["backends"])) == 2
    assert line["completion_tokens"] == 4 and line["ttft_s"] is not None
