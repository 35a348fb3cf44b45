"""Gateway-side scraping: a `kind: openai` backend with `scrape:` needs no agent of its own."""

from __future__ import annotations

from pathlib import Path

import httpx

from testkit.harness import free_port, run_gateway, write_config
from tests.e2e.test_external_engines import MODEL, spawn, stop


def test_scraped_backend_is_healthy_and_follows_its_metrics(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm")
    try:
        config = write_config(tmp_path, {
            "model": MODEL,
            "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20},
            "backends": [{"id": "scraped", "kind": "openai", "gpu": "L40S", "address": url,
                          "scrape": {"engine": "vllm", "interval_ms": 100}}],
        })
        with run_gateway(config, healthy=1, timeout=30) as gw:
            httpx.post(f"{url}/control", json={"waiting": 7}, timeout=5).raise_for_status()
            gw.wait_until(lambda: gw.backend("scraped")["queue_depth"] == 7)
            b = gw.backend("scraped")
            assert b["kv_total_bytes"] == 4096 * 16 * 524288 and b["kv_free_bytes"] == b["kv_total_bytes"] * 3 // 4
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        stop(engine)
