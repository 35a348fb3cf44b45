"""Managed kind: openai engines: the gateway starts a fake OpenAI server through `launch:` (a slow start
and child processes, as vLLM has), restarts it after kill -9 with its children gone, and leaves nothing
behind on SIGTERM or SIGKILL of the gateway."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from testkit.harness import Gateway, run_gateway, write_config

MODEL = "llava-1.5-7b"
BACKEND = "managed-vllm"


def managed_config(tmp: Path, start_delay_s: float) -> Path:
    command = [sys.executable, "-m", "tests.fake_openai_server", "--port", "{port}", "--engine", "vllm",
               "--start-delay", str(start_delay_s), "--children", "2"]
    return write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "engine_stop_timeout_s": 4},
        "backends": [{"id": BACKEND, "kind": "openai", "gpu": "H100", "scrape": {"engine": "vllm", "interval_ms": 100},
                      "launch": {"command": command, "start_timeout_s": 60, "probe_interval_s": 0.1}}],
    })


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs nothing and holds no GPU)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in {"Z", "X"}
    except (FileNotFoundError, ProcessLookupError):
        return True


def engine_stats(gw: Gateway) -> dict[str, Any]:
    address = gw.backend(BACKEND)["address"]
    return dict(httpx.get(f"{address}/stats", timeout=5).json())


def engine_pids(gw: Gateway) -> list[int]:
    stats = engine_stats(gw)
    return [stats["pid"], *stats["children"]]


def chat(gw: Gateway) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)


def test_starting_until_ready_restarted_after_kill_9_and_stopped_with_the_gateway(tmp_path: Path) -> None:
    # a 1.5 s load (after the server's imports): the gateway answers long before it is over
    with run_gateway(managed_config(tmp_path, start_delay_s=1.5), healthy=0) as gw:
        assert gw.backend(BACKEND)["state"] == "starting"   # the model is still "loading"
        gw.wait_until(lambda: gw.backend(BACKEND)["state"] == "healthy", timeout=60)
        assert chat(gw).status_code == 200
        first = engine_pids(gw)
        assert len(first) == 3 and not any(gone(p) for p in first)

        os.kill(first[0], signal.SIGKILL)
        gw.wait_until(lambda: all(gone(p) for p in first), timeout=30)   # its workers went with it
        gw.wait_until(lambda: gw.backend(BACKEND)["state"] == "healthy" and engine_pids(gw)[0] != first[0],
                      timeout=60)
        assert chat(gw).status_code == 200
        second = engine_pids(gw)
        gw.process.send_signal(signal.SIGTERM)
        assert gw.process.wait(timeout=30) == 0
        assert all(gone(p) for p in second), "a stopped gateway leaves no engine process behind"


def test_a_gateway_killed_with_sigkill_leaves_no_engine_behind(tmp_path: Path) -> None:
    with run_gateway(managed_config(tmp_path, start_delay_s=0.0), healthy=1, timeout=60) as gw:
        pids = engine_pids(gw)
        gw.process.kill()
        gw.process.wait(timeout=10)
        gw.wait_until(lambda: all(gone(p) for p in pids), timeout=30)
