"""An agent that moves its external backend to another address (with the cluster token, README "Address
moves"), real processes on 127.0.0.1: the gateway's probe follows the move, so the backend serves from
its new address once the old one is gone. The probe went on asking the old address and found the
backend unreachable for good, though its agent reported from the new one."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from testkit.harness import free_port, run_gateway, write_config
from tests.e2e.test_external_engines import MODEL, spawn, stop

TOKEN = "address-move-token-0123456789"


def test_the_probe_follows_an_agents_address_move(tmp_path: Path) -> None:
    (tmp_path / "cluster.token").write_text(f"{TOKEN}\n")
    ports = free_port(), free_port()
    old_url, new_url = (f"http://127.0.0.1:{p}" for p in ports)
    old, new = (spawn("tests.fake_openai_server", "--port", str(p), "--engine", "vllm") for p in ports)
    config = write_config(tmp_path, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "auth": {"cluster_token_file": str(tmp_path / "cluster.token")}},
        "backends": [{"id": "ext", "kind": "openai", "role": "language", "gpu": "A100-80GB", "address": old_url,
                      "agent": True}],
    })
    try:
        with run_gateway(config, healthy=0) as gw:
            agent = spawn("backends.agent", "--engine", "vllm", "--address", new_url, "--backend-id", "ext",
                          "--gpu", "A100-80GB", "--model", MODEL, "--gateway", f"127.0.0.1:{gw.grpc_port}",
                          "--interval-ms", "100", "--kv-total-tokens", "100000",
                          "--token-file", str(tmp_path / "cluster.token"))
            try:
                gw.wait_until(lambda: gw.backend("ext")["address"] == new_url and gw.backend("ext")["healthy"],
                              timeout=30)
                stop(old)
                time.sleep(1.5)   # several probes (every 100 ms) since the old address went
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                resp = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
                assert resp.status_code == 200, resp.text
                moved = gw.backend("ext")
                assert moved["reachable"] is True and moved["last_error"] is None, moved
                assert httpx.get(f"{new_url}/stats", timeout=5).json()["served"] == 1
            finally:
                stop(agent)
    finally:
        stop(old)
        stop(new)
