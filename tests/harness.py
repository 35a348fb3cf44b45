"""Start a real gateway process (with its managed simulated engines) on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_config(tmp: Path, *, time_scale: float = 0.2, **gateway: Any) -> Path:
    """The default demo cluster with a faster clock and optional gateway-setting overrides."""
    data = yaml.safe_load((ROOT / "configs" / "backends.yaml").read_text())
    for b in data["backends"]:
        if "launch" in b:
            b["launch"] = {**b["launch"], "time_scale": time_scale}
    data.setdefault("gateway", {}).update(gateway)
    return write_config(tmp, data)


def write_config(tmp: Path, data: dict[str, Any]) -> Path:
    path = tmp / "backends.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    url: str
    grpc_port: int
    log_path: Path
    admin_key: str | None = None

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def backends(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.url}/admin/backends", headers=self.admin_headers, timeout=5)
        return list(resp.json()["data"])

    def backend(self, backend_id: str) -> dict[str, Any]:
        return next(b for b in self.backends() if b["id"] == backend_id)

    def wait_until(self, predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"condition not met within {timeout} s; gateway log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def run_gateway(
    config: Path, *extra: str, healthy: int | None = None, timeout: float = 60.0, admin_key: str | None = None
) -> Iterator[Gateway]:
    """Run `gateway --backends config` until the block ends; wait until `healthy` backends heartbeat."""
    port, grpc_port = free_port(), free_port()
    log_path = config.parent / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--port", str(port),
           "--grpc-port", str(grpc_port), "--log-level", "warning", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    gw = Gateway(proc, f"http://127.0.0.1:{port}", grpc_port, log_path, admin_key)
    try:
        want = healthy if healthy is not None else len(yaml.safe_load(config.read_text())["backends"])

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log_tail()}")
            try:
                return sum(b["healthy"] for b in gw.backends()) >= want
            except httpx.HTTPError:
                return False

        gw.wait_until(ready, timeout=timeout, interval=0.2)
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --- Fault injection, metrics and SSE helpers for the integration / end-to-end tests -------------


def engine_pid(gw: Gateway, backend_id: str) -> int:
    """The pid a backend's engine reports in its heartbeats (waits for the first one)."""
    return int(gw.wait_until(lambda: gw.backend(backend_id)["pid"], timeout=10))


def wait_all_healthy(gw: Gateway, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Block until every backend of the gateway heartbeats; returns /admin/backends then."""
    return list(gw.wait_until(lambda: (bs := gw.backends()) and all(b["healthy"] for b in bs) and bs, timeout=timeout))


@contextmanager
def sigstopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the block and SIGCONT it on the way out, whatever happens inside."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def metric_total(gw: Gateway, name: str, **labels: str) -> float:
    """Sum of the samples called `name` in /metrics whose labels include `labels` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gw.url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of the `data:` lines of a server-sent-event stream, in order."""
    for line in lines:
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


def long_request_id(min_tokens: int, prefix: str = "long") -> str:
    """A request id whose simulated natural completion is at least `min_tokens` tokens long.

    Simulated engines stop a request at a length drawn from its id (x-request-id is honoured), so a
    test that needs a long generation picks its id.
    """
    from backends.sim_executor import natural_length

    return next(f"{prefix}-{i}" for i in range(100_000) if natural_length(f"{prefix}-{i}") >= min_tokens)


def short_request_id(max_tokens: int, prefix: str = "short") -> str:
    """A request id whose simulated natural completion is at most `max_tokens` tokens long."""
    from backends.sim_executor import natural_length

    return next(f"{prefix}-{i}" for i in range(100_000) if natural_length(f"{prefix}-{i}") <= max_tokens)
