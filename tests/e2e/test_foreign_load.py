"""Load other clients put on an upstream directly: two demo upstreams on 127.0.0.1, a conversation whose
turns go back where its history is cached, until that engine reports a queue this gateway did not send
(as a vLLM shared with other clients does in its /metrics); then the next turn goes to the other one.
The gateway's view: `foreign_waiting` and `foreign_backlog_tokens` in /admin/backends."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, free_port, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"
IDS = ("up-a", "up-b")
pytestmark = pytest.mark.timeout(120)


def chat(gw: Gateway, text: str) -> str:
    resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    return str(resp.headers["x-heterogate-backend"])


def set_waiting(url: str, waiting: int) -> None:
    httpx.post(f"{url}/control", json={"waiting": waiting}, timeout=5).raise_for_status()


def test_a_turn_leaves_an_engine_other_clients_keep_busy(tmp_path: Path) -> None:
    ports = {bid: free_port() for bid in IDS}
    urls = {bid: f"http://127.0.0.1:{port}" for bid, port in ports.items()}
    upstreams = [spawn("tests.fake_openai_server", "--port", str(ports[bid]), "--engine", "vllm") for bid in IDS]
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100}, "backends": [
        {"id": bid, "kind": "openai", "gpu": "H100", "address": urls[bid],
         "scrape": {"engine": "vllm", "interval_ms": 100}} for bid in IDS]})
    try:
        with run_gateway(config, healthy=2, timeout=60) as gw:
            history = " ".join(f"line {i} of a long shared history" for i in range(300))   # ~2,400 tokens
            first = chat(gw, history)
            other = next(bid for bid in IDS if bid != first)
            history += " and the answer, then a question"
            assert chat(gw, history) == first   # the history cached there, both idle: affinity
            set_waiting(urls[first], 40)   # 40 requests of other clients queue there
            gw.wait_until(lambda: gw.backend(first)["foreign_waiting"] == 40)
            assert gw.backend(first)["foreign_backlog_tokens"] > 40 * 500   # at the mean prompt routed
            assert gw.backend(other)["foreign_waiting"] == 0
            metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
            assert f'heterogate_backend_foreign_waiting{{backend="{first}",gpu="H100",role="language"}} 40.0' in metrics
            history += " and another answer, then another question"
            assert chat(gw, history) == other
            set_waiting(urls[first], 0)
            gw.wait_until(lambda: gw.backend(first)["foreign_backlog_tokens"] == 0)
    finally:
        for upstream in upstreams:
            stop(upstream)
