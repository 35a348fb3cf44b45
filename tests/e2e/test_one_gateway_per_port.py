"""One gateway per port: a second gateway pointed at a taken HTTP or control port exits with an error
naming the port, launches none of its engines, and the first one keeps serving."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config
from tests.e2e.test_managed_engines import BACKEND, MODEL, chat, managed_config


def second_gateway(tmp: Path, port: int, grpc_port: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run a gateway whose one managed engine would leave `marker` behind if it were ever launched."""
    marker = tmp / "launched"
    touch = [sys.executable, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).touch()", str(marker), "{port}"]
    config = write_config(tmp, {"model": MODEL, "backends": [
        {"id": "second", "kind": "openai", "gpu": "L40S", "launch": {"command": touch}}]})
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--port", str(port),
         "--grpc-port", str(grpc_port), "--log-level", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    return done, marker


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gateway whose ports are taken, shared by both cases: a second gateway that fails changes nothing
    in it (each case checks that it still serves from the same engine)."""
    with run_gateway(managed_config(tmp_path_factory.mktemp("first"), start_delay_s=0.0), healthy=1,
                     timeout=60) as gw:
        yield gw


@pytest.mark.parametrize("taken", ["http", "control"])
def test_a_second_gateway_on_a_taken_port_starts_nothing(first: Gateway, tmp_path: Path, taken: str) -> None:
    gw = first
    address = gw.backend(BACKEND)["address"]
    http_port = int(gw.url.rsplit(":", 1)[1])
    port, grpc_port = (http_port, free_port()) if taken == "http" else (free_port(), gw.grpc_port)
    done, marker = second_gateway(tmp_path, port, grpc_port)
    assert done.returncode == 1
    what = "HTTP port" if taken == "http" else "control gRPC port"
    assert f"cannot bind the {what} 127.0.0.1:{port if taken == 'http' else grpc_port}" in done.stderr
    assert not marker.exists(), "no engine may be launched by a gateway that cannot serve"
    assert chat(gw).status_code == 200
    b = gw.backend(BACKEND)
    assert b["state"] == "healthy" and b["address"] == address
    assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200


def test_an_engine_of_another_gateway_cannot_replace_this_gateways_engine(tmp_path: Path) -> None:
    """A process that heartbeats under a managed id without the identity this gateway gave its own
    engine (an engine of some other gateway, say) is refused; the backend stays with its own engine."""
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100},
                                     "backends": [{"id": "e0", "gpu": "H100", "launch": {"time_scale": 0.05}}]})
    with run_gateway(config, healthy=1) as gw:
        own = gw.backend("e0")
        log = tmp_path / "rogue.log"
        with open(log, "wb") as out:
            rogue = subprocess.Popen(
                [sys.executable, "-m", "backends.engine", "--backend-id", "e0", "--gpu", "H100", "--model", MODEL,
                 "--gateway", f"127.0.0.1:{gw.grpc_port}", "--heartbeat-ms", "100", "--log-level", "warning"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            gw.wait_until(lambda: "PERMISSION_DENIED" in log.read_text(errors="replace"), timeout=30)
            assert gw.backend("e0")["pid"] == own["pid"] and gw.backend("e0")["address"] == own["address"]
        finally:
            rogue.kill()
            rogue.wait()
        gw.wait_until(lambda: gw.backend("e0")["healthy"], timeout=30)
        assert gw.backend("e0")["pid"] == own["pid"]
        assert chat(gw).status_code == 200
