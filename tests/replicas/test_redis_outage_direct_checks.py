"""A long Redis outage, as real processes on 127.0.0.1: two engines heartbeat to replica A only;
replica B knows them only through Redis. With Redis killed for longer than `fail_open_hold_s`, B keeps
serving on the engines that answer its own checks, drops the one that is killed, and takes the normal
path again once Redis is back."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from testkit.harness import ROOT, Gateway, free_ports, metric_total, run_gateway, write_config
from tests.replicas.redis_helpers import fresh_prefix, redis_server

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")]
MODEL = "llava-1.5-7b"
ENGINES = {"e0": "H100", "e1": "L40S"}
HEARTBEAT_MS = 100   # the miss window is 3 heartbeats: 0.3 s


def replica_config(tmp: Path, name: str, prefix: str, ports: dict[str, int]) -> Path:
    d = tmp / name
    d.mkdir()
    return write_config(d, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": HEARTBEAT_MS, "redis": {
            "key_prefix": prefix, "fail_open_hold_s": 1.0, "held_check_interval_s": 0.5,
            "held_check_timeout_s": 0.5, "held_check_failures": 2}},
        "backends": [{"id": backend_id, "gpu": gpu, "address": f"127.0.0.1:{ports[backend_id]}"}
                     for backend_id, gpu in ENGINES.items()],
    })


@contextmanager
def engines(tmp: Path, control_port: int, ports: dict[str, int]) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The engines on `ports`, heartbeating to one control port only (killed afterwards)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for backend_id, gpu in ENGINES.items():
            with open(tmp / f"{backend_id}.log", "wb") as log:
                procs[backend_id] = subprocess.Popen(
                    [sys.executable, "-m", "backends.engine", "--backend-id", backend_id, "--gpu", gpu,
                     "--model", MODEL, "--gateway", f"127.0.0.1:{control_port}", "--port", str(ports[backend_id]),
                     "--time-scale", "0.2",
                     "--heartbeat-ms", str(HEARTBEAT_MS), "--log-level", "warning"],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def chat(gw: Gateway) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30).status_code


def healthy(gw: Gateway) -> set[str]:
    return {b["id"] for b in gw.backends() if b["healthy"]}


def test_a_replica_without_the_engines_streams_serves_through_a_long_redis_outage(tmp_path: Path) -> None:
    prefix = fresh_prefix("outage")
    ports = dict(zip(ENGINES, free_ports(len(ENGINES)), strict=True))
    with ExitStack() as stack:
        url, port, redis_proc = stack.enter_context(redis_server())
        a = stack.enter_context(run_gateway(replica_config(tmp_path, "a", prefix, ports), "--redis-url", url,
                                            healthy=0))
        procs = stack.enter_context(engines(tmp_path, a.grpc_port, ports))
        a.wait_until(lambda: healthy(a) == set(ENGINES), timeout=30)
        b = stack.enter_context(run_gateway(replica_config(tmp_path, "b", prefix, ports), "--redis-url", url,
                                            healthy=len(ENGINES)))
        assert chat(b) == 200

        redis_proc.kill()
        redis_proc.wait()
        b.wait_until(lambda: "shared_state_hold_expired" in b.log_path.read_text(), timeout=20)
        time.sleep(1.0)   # several miss windows past the hold: a backend not kept alive would be stale by now
        assert metric_total(b, "heterogate_shared_state_up") == 0
        assert healthy(b) == set(ENGINES)
        assert metric_total(b, "heterogate_shared_state_held_backends") == len(ENGINES)
        assert [chat(b) for _ in range(4)] == [200] * 4

        procs["e1"].send_signal(signal.SIGKILL)
        procs["e1"].wait()
        b.wait_until(lambda: healthy(b) == {"e0"}, timeout=20)
        assert "shared_state_held_unreachable" in b.log_path.read_text()
        assert [chat(b) for _ in range(4)] == [200] * 4   # the survivor serves them all

        with redis_server(port):
            b.wait_until(lambda: metric_total(b, "heterogate_shared_state_up") == 1, timeout=20)
            # e0 is heard through Redis again, so nothing is held any more; e1 stays gone
            b.wait_until(lambda: metric_total(b, "heterogate_shared_state_held_backends") == 0, timeout=20)
            assert healthy(b) == {"e0"}
            assert chat(b) == 200
