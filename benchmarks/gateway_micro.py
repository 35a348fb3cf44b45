"""The gateway's own Python cost per request, in process: no sockets, no gRPC, no other process.

    python benchmarks/gateway_micro.py [--quick] [--requests 3000] [--repeats 5]

The real front door (`gateway.doors.routes.create_server` over `gateway.runtime.build_runtime`, one
backend) is called in process, on uvloop: each request is handed to the server's handler for its path
(the completions door, or the route table for the other routes) as the server would after parsing it,
with the response written to a sink instead of a socket, and a fake engine client in place of the
gRPC one (it yields max_tokens GenerateChunks at once). What is left is everything the
gateway does in Python for a request: the door, body parsing and validation, job building,
admission, routing, metrics, logging calls, response rendering. Subtracting it from the gateway's
CPU per request under wrk (gateway_overhead.py) leaves the HTTP parsing and socket I/O and the
grpc.aio client with its threads.

Each cell: `requests` sequential requests, CPU time of this process (time.process_time) divided by
the count; the minimum over `repeats` (the least disturbed by other processes). Cells: GET /health;
POST /v1/chat/completions non-streaming and streaming; then the non-streaming request with one
GenerateChunk for the whole completion (chunk_all). Writes
benchmarks/results/gateway_micro.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_cluster import cluster_config  # noqa: E402
from benchmarks.gateway_overhead import CHAT, git_state, save_report  # noqa: E402
from common.logs import configure_logging  # noqa: E402
from common.wire import engine_pb2  # noqa: E402
from gateway.config.cluster import load_cluster  # noqa: E402
from gateway.doors.http_server import Exchange, HttpServer, Request  # noqa: E402
from gateway.doors.routes import create_server  # noqa: E402
from gateway.requests.job import GenerationJob  # noqa: E402
from gateway.routing.backend_entry import Reported  # noqa: E402
from gateway.runtime import Runtime, build_runtime  # noqa: E402
from testkit.harness import write_config  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gateway_micro.json"


class FakeEngineClient:
    """Stands in for gateway.clients.engine_client.EngineClient: the chunks a fast engine sends, no I/O."""

    handoff = "none"

    def __init__(self, backend_id: str, tokens_per_chunk: int = 1) -> None:
        self.backend_id = backend_id
        self.address = "fake:0"
        self.tokens_per_chunk = tokens_per_chunk

    async def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        n = job.max_tokens
        per = self.tokens_per_chunk or n
        for start in range(0, n, per):
            end = min(n, start + per)
            chunk = engine_pb2.GenerateChunk(text="word " * (end - start), index=end - 1)
            if end == n:
                chunk.finish_reason = "length"
                chunk.usage.prompt_tokens = job.prompt_tokens
                chunk.usage.completion_tokens = n
            yield chunk

    async def close(self) -> None:
        pass


def make_runtime(tmp: Path, tokens_per_chunk: int) -> Runtime:
    config = load_cluster(write_config(tmp, cluster_config("stub", ["127.0.0.1:9"])))
    runtime = build_runtime(config)
    # No injection point for a backend client exists, so the benchmark replaces the gRPC one.
    runtime.clients._clients["e0"] = FakeEngineClient("e0", tokens_per_chunk)  # type: ignore[assignment]
    return runtime


def beat(runtime: Runtime) -> None:
    """A heartbeat, so that the backend stays healthy (sequence numbers must grow)."""
    seq, total = time.monotonic_ns(), 50 << 30
    runtime.table.apply_heartbeat("e0", seq, "fake:0", Reported(seq=seq, kv_free_bytes=total, kv_total_bytes=total))


class Sink:
    """Stands in for the server's connection: keeps what a response writes, never disconnects."""

    keep_alive = True
    _transport = None

    def __init__(self) -> None:
        self.data: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.data.append(data)

    async def drain(self) -> None:
        pass

    def status(self) -> int:
        return int(b"".join(self.data)[9:12])


async def one(server: HttpServer, method: str, path: str, body: bytes) -> int:
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    request = Request(method, path.encode(), b"", headers, body, True)
    sink = Sink()
    exchange = Exchange(sink, False, True)  # type: ignore[arg-type]
    await server.routes.get(path, server.fallback)(request, exchange)
    return sink.status()


async def cell(runtime: Runtime, server: HttpServer, method: str, path: str, body: bytes, requests: int,
               repeats: int) -> float:
    """Minimum over repeats of CPU µs per request."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for i in range(requests):
            if i % 64 == 0:
                beat(runtime)
            status = await one(server, method, path, body)
            if status != 200:
                raise RuntimeError(f"{method} {path}: status {status}")
        best = min(best, (time.process_time() - t0) / requests * 1e6)
    return best


async def measure(requests: int, repeats: int) -> dict[str, float]:
    body = json.dumps(CHAT).encode()
    stream_body = json.dumps({**CHAT, "stream": True}).encode()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gateway-micro-") as tmp:
        runtime = make_runtime(Path(tmp), 1)
        server = create_server(runtime, idle_s=75.0)
        await cell(runtime, server, "POST", "/v1/chat/completions", body, 200, 1)   # warm-up
        out["GET /health"] = await cell(runtime, server, "GET", "/health", b"", requests, repeats)
        out["chat"] = await cell(runtime, server, "POST", "/v1/chat/completions", body, requests, repeats)
        out["chat stream"] = await cell(runtime, server, "POST", "/v1/chat/completions", stream_body, requests,
                                        repeats)
        runtime = make_runtime(Path(tmp), 0)
        out["chat, chunk_all"] = await cell(runtime, create_server(runtime, idle_s=75.0), "POST",
                                            "/v1/chat/completions", body, requests, repeats)
    gc.unfreeze()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run (< 30 s): 500 requests x 2 repeats")
    p.add_argument("--requests", type=int, help="requests per repeat (default 3000)")
    p.add_argument("--repeats", type=int, help="repeats per cell (default 5)")
    args = p.parse_args(argv)
    requests = args.requests or (500 if args.quick else 3000)
    repeats = args.repeats or (2 if args.quick else 5)
    started = time.monotonic()
    configure_logging("warning")   # as benchmarked: gateway --log-level warning
    cells = uvloop.run(measure(requests, repeats))
    base = cells["chat"]
    print(f"\n{'in-process handler call (fake engine, max_tokens 4)':52s} {'CPU µs/req':>10s} {'vs chat':>8s}")
    for name, us in cells.items():
        print(f"{name:52s} {us:10.1f} {us / base - 1:+8.1%}")
    report = {"benchmark": "gateway_micro", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "git": git_state(), "requests": requests, "repeats": repeats, "cpu_us_per_request": cells,
              "wall_s": time.monotonic() - started}
    save_report(OUT, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
