"""Start a real gateway process (with its managed simulated engines) on free loopback ports."""

from __future__ import annotations

import functools
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1 (held together while picked: ports picked one at a time can
    come back the same)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def demo_config(tmp: Path, *, time_scale: float = 0.2, per_backend: dict[str, dict[str, Any]] | None = None,
                **gateway: Any) -> Path:
    """The default demo cluster with a faster clock and optional gateway-setting overrides; `per_backend`:
    settings added to the entries of these backend ids."""
    data = yaml.safe_load((ROOT / "configs" / "backends.yaml").read_text())
    for b in data["backends"]:
        if "launch" in b:
            b["launch"] = {**b["launch"], "time_scale": time_scale}
        b.update((per_backend or {}).get(b["id"], {}))
    data.setdefault("gateway", {}).update(gateway)
    return write_config(tmp, data)


def finished(proc: subprocess.Popen[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The process's exit status and output once it exits; killed (and the timeout raised) past `timeout_s`."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


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
    verify: Any = True   # an HTTPS door: an SSL context trusting its CA

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, verify=self.verify)

    def backends(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.url}/admin/backends", headers=self.admin_headers, timeout=5, verify=self.verify)
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

    def log_records(self) -> list[dict[str, Any]]:
        """The gateway's JSON log lines written whole so far: the last one may be still being written (the
        file is read while the gateway writes it), so only lines ending in a newline count."""
        data = self.log_path.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]
        return [orjson.loads(ln) for ln in whole.splitlines() if ln.startswith(b"{")]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def run_gateway(
    config: Path, *extra: str, healthy: int | None = None, timeout: float = 120.0, admin_key: str | None = None,
    https_ca: Path | None = None, env: dict[str, str] | None = None,
) -> Iterator[Gateway]:
    """Run `gateway --backends config` until the block ends; wait until `healthy` backends heartbeat.
    `https_ca`: the HTTP door speaks TLS with a certificate from this CA. Free ports are picked, then
    bound by the gateway: another process may take one in between (an engine's ephemeral port, another
    test's), so a start that cannot bind its ports is tried again on others, at most BIND_TRIES times."""
    want = healthy if healthy is not None else len(yaml.safe_load(config.read_text())["backends"])
    for attempt in range(1, BIND_TRIES + 1):
        gw = _launch(config, extra, admin_key, https_ca, env)
        try:
            gw.wait_until(functools.partial(_ready, gw, want), timeout=timeout)   # every test's gateway waits here
        except _PortTaken:
            if attempt == BIND_TRIES:
                raise
            continue
        except BaseException:
            stop_process(gw.process)
            raise
        break
    try:
        yield gw
    finally:
        stop_process(gw.process)


BIND_TRIES = 3


class _PortTaken(RuntimeError):
    """The gateway could not bind a port picked free a moment before."""


def _launch(config: Path, extra: tuple[str, ...], admin_key: str | None, https_ca: Path | None,
            env: dict[str, str] | None) -> Gateway:
    port, grpc_port = free_ports(2)
    log_path = config.parent / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--port", str(port),
           "--grpc-port", str(grpc_port), "--log-level", "warning", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    scheme = "https" if https_ca else "http"
    verify = ssl.create_default_context(cafile=str(https_ca)) if https_ca else True
    return Gateway(proc, f"{scheme}://127.0.0.1:{port}", grpc_port, log_path, admin_key, verify)


def _ready(gw: Gateway, want: int) -> bool:
    if gw.process.poll() is not None:
        tail = gw.log_tail()
        if f"cannot bind the HTTP port 127.0.0.1:{gw.url.rsplit(':', 1)[1]}" in tail or (
                "cannot bind the control gRPC port" in tail and str(gw.grpc_port) in tail):
            raise _PortTaken(tail)
        raise RuntimeError(f"gateway exited with {gw.process.returncode}:\n{tail}")
    try:
        return sum(b["healthy"] for b in gw.backends()) >= want
    except (httpx.HTTPError, ValueError, KeyError):   # not up yet, or another process's server on its port
        return False   # (the gateway then exits, unable to bind it: the next call sees that)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM, and SIGKILL if it is still running `timeout_s` later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
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


# --- Multimodal helpers: images in memory, a recording image server, standalone engines ----------


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (32, 32), *, noise: bool = False, seed: int = 0) -> bytes:
    """An image file made with Pillow in memory (`noise`: random pixels, so it does not compress)."""
    import io
    import random

    from PIL import Image

    img = Image.new("RGB", size, (200, 40, 90))
    if noise:
        rng = random.Random(seed)
        img.frombytes(rng.randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same messages with every image part removed (the text, and so its token count, unchanged)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [p for p in content if p.get("type") != "image_url"]}
        out.append(m)
    return out


@dataclass
class ImageServer:
    """A loopback HTTP server for image-URL tests: /cat.png (200), /redirect (302 to /cat.png), else 404."""

    port: int
    hits: list[str]

    def url(self, path: str = "/cat.png", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def serving_images(png: bytes) -> Iterator[ImageServer]:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("location", "/cat.png")
                self.send_header("content-length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ImageServer(int(server.server_address[1]), hits)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class StandaloneEngines:
    """Engine processes outside any gateway, heartbeating to a Control service that the test runs.

    The Control service (the gateway's own `ControlService` on a `StateTable`) runs on a grpc.aio
    server in a background thread; `reported(id)` reads what an engine last reported and `address(id)`
    where its Engine service listens (engines bind an ephemeral port and say so in heartbeats).
    """

    def __init__(self, model: str, log_dir: Path, heartbeat_ms: int = 100) -> None:
        from common.catalog import load_catalog

        self.catalog = load_catalog()
        self.model = model
        self.heartbeat_ms = heartbeat_ms
        self.log_dir = log_dir
        self.table: Any = None
        self.control_port = 0
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._loop: Any = None
        self._thread: Any = None
        self._server: Any = None

    def start(self) -> None:
        import asyncio
        import threading

        import grpc

        from common.wire import control_pb2_grpc
        from gateway.control.heartbeat_service import ControlService
        from gateway.routing.signals import LocalSignals
        from gateway.routing.state_table import StateTable

        started = threading.Event()

        async def serve() -> None:
            self.table = StateTable(self.catalog.model(self.model), self.heartbeat_ms / 1000, miss_limit=5)
            self._server = grpc.aio.server()
            control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(self.table)), self._server)
            self.control_port = self._server.add_insecure_port("127.0.0.1:0")
            await self._server.start()
            started.set()

        def run() -> None:
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=run, name="standalone-control", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the test's Control service did not start")

    def launch(self, backend_id: str, role: str, gpu: str, *args: str) -> subprocess.Popen[bytes]:
        import asyncio

        async def register() -> None:
            self.table.register(backend_id, role, self.catalog.gpu(gpu), address=None, managed=False,
                                steal="--steal" in args)

        asyncio.run_coroutine_threadsafe(register(), self._loop).result(5)
        cmd = [sys.executable, "-m", "backends.engine", "--backend-id", backend_id, "--role", role, "--gpu", gpu,
               "--model", self.model, "--gateway", f"127.0.0.1:{self.control_port}", "--port", "0",
               "--heartbeat-ms", str(self.heartbeat_ms), "--log-level", "warning", *args]
        with open(self.log_dir / f"{backend_id}.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        self._procs[backend_id] = proc
        return proc

    def reported(self, backend_id: str) -> Any:
        return self.table.get(backend_id).reported

    def address(self, backend_id: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._procs[backend_id]
            if proc.poll() is not None:
                log = (self.log_dir / f"{backend_id}.log").read_text(errors="replace")
                raise RuntimeError(f"engine {backend_id} exited with {proc.returncode}:\n{log[-3000:]}")
            entry = self.table.get(backend_id)
            if entry is not None and entry.last_heartbeat is not None and entry.address:
                return str(entry.address)
            time.sleep(0.05)
        raise TimeoutError(f"engine {backend_id} sent no heartbeat within {timeout} s")

    def wait_reported(self, backend_id: str, predicate: Any, timeout: float = 10.0) -> Any:
        """Poll the engine's last heartbeat until `predicate(reported)` holds; returns that report."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rep = self.reported(backend_id)
            if predicate(rep):
                return rep
            time.sleep(0.02)
        raise TimeoutError(f"engine {backend_id}: condition not met within {timeout} s; last report {rep}")

    def close(self) -> None:
        import asyncio

        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._loop is not None:
            if self._server is not None:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


@contextmanager
def standalone_engines(model: str, log_dir: Path, heartbeat_ms: int = 100) -> Iterator[StandaloneEngines]:
    engines = StandaloneEngines(model, log_dir, heartbeat_ms)
    engines.start()
    try:
        yield engines
    finally:
        engines.close()
