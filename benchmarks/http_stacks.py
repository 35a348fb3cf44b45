"""The front door's HTTP stack, chosen by measurement: the gateway's completion routes on its own server,
on uvicorn (httptools, uvloop) and on granian (RSGI), side by side in one run.

    python benchmarks/http_stacks.py [--rounds 5] [--duration 4] [--stacks own,uvicorn,granian] [--out FILE]
    python benchmarks/http_stacks.py --serve STACK --backends FILE --port N     # one server (the run starts them)

Each stack runs in a process of its own that builds the same gateway runtime (`build_runtime`, the
completions door's handlers, the daemon's GC settings) from the same config: two `kind: openai`
backends, benchmarks/mock_openai_engine.py on loopback. Only the HTTP layer differs:

    own       gateway/doors/http_server.py (what the gateway serves on)
    uvicorn   uvicorn.Server with http="httptools" on uvloop, access log off, an ASGI app that calls the
              same handlers through an exchange that turns their writes into ASGI messages
    granian   granian's embedded server (Rust I/O threads, the handlers on this process's asyncio loop)
              with an RSGI app doing the same with `response_bytes` and `response_stream`

Neither adapter watches for a client that leaves (the own server cancels the handler from
`connection_lost`; uvicorn and granian would need a task per request awaiting `receive()` or
`client_disconnect()`): the comparison leaves that cost out of theirs, in their favour.

Per round, the stacks in rotating order, each with wrk (c=64, keep-alive, max_tokens 4): req/s and
the CPU µs a request of the server's process (/proc, all its threads), non-streamed and streamed
(32 chunks); p50 and p99 latency of the non-streamed run. Cells are medians over rounds, and each
stack's CPU a request is also given as a ratio to the own server's of the same round. Writes
benchmarks/results/http_stacks.json and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from benchmarks.front_door import body, mock_engines, openai_config, process, wait_http  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from testkit.harness import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "http_stacks.json"
STACKS = ("own", "uvicorn", "granian")
Headers = list[tuple[bytes, bytes]]


class BufferedExchange:
    """The completions door's `Exchange` for servers that are not the own one: the handler's writes are
    kept as (status, headers) and pieces, and `flush` hands them to the server (`drain`, the handler's
    wait for a slow client, flushes; so does the end of the handler)."""

    def __init__(self, head_only: bool) -> None:
        self.started = self.done = self.gone = False
        self.status, self.headers = 200, []
        self.pieces: list[bytes] = []
        self.whole = False
        self._head_only = head_only

    def respond(self, status: int, headers: Headers, body: bytes, content_type: bytes = b"application/json") -> None:
        self.started = self.done = self.whole = True
        self.status, self.headers = status, [(b"content-type", content_type), *headers]
        self.pieces = [b"" if self._head_only else body]

    def start_stream(self, status: int, headers: Headers, *, sized: bool = False) -> None:
        self.started = True
        self.status, self.headers = status, headers

    def send(self, data: bytes) -> None:
        if data:
            self.pieces.append(data)

    async def drain(self) -> None:
        await self.flush(False)

    def end_stream(self, tail: bytes = b"") -> None:
        self.done = True
        self.send(tail)

    async def flush(self, last: bool) -> None:
        raise NotImplementedError


def asgi_app(routes: dict[str, Any]) -> Callable[..., Awaitable[None]]:
    """The completion routes as an ASGI app (404 elsewhere)."""
    from gateway.doors.http_server import Request

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                  send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        handler = routes.get(scope["path"])
        if handler is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        request = Request(scope["method"], scope["raw_path"], scope["query_string"], scope["headers"],
                          b"".join(chunks), scope["http_version"] == "1.1")

        class Exchange(BufferedExchange):
            opened = False

            async def flush(self, last: bool) -> None:
                if self.whole:
                    await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
                    await send({"type": "http.response.body", "body": self.pieces[0]})
                    return
                if not self.opened:
                    self.opened = True
                    await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
                data, self.pieces = b"".join(self.pieces), []
                await send({"type": "http.response.body", "body": data, "more_body": not last})

        exchange = Exchange(request.method == "HEAD")
        await handler(request, exchange)
        await exchange.flush(True)

    return app


class RsgiApp:
    """The completion routes as an RSGI app (404 elsewhere)."""

    def __init__(self, routes: dict[str, Any]) -> None:
        self._routes = routes

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        from gateway.doors.http_server import Request

        handler = self._routes.get(scope.path)
        if handler is None:
            protocol.response_empty(404, [])
            return
        raw = await protocol()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()]
        request = Request(scope.method, scope.path.encode(), scope.query_string.encode(), headers, raw,
                          scope.http_version == "1.1")

        class Exchange(BufferedExchange):
            transport: Any = None

            async def flush(self, last: bool) -> None:
                head = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.headers]
                if self.whole:
                    protocol.response_bytes(self.status, head, self.pieces[0])
                    return
                if self.transport is None:
                    self.transport = protocol.response_stream(self.status, head)
                data, self.pieces = b"".join(self.pieces), []
                if data:
                    await self.transport.send_bytes(data)

        exchange = Exchange(request.method == "HEAD")
        await handler(request, exchange)
        await exchange.flush(True)


async def serve(stack: str, backends: Path, port: int) -> None:
    """One stack serving the gateway's completion routes until killed."""
    from gateway.config.cluster import load_cluster
    from gateway.daemon import GC_THRESHOLDS
    from gateway.doors.completions import CompletionsDoor
    from gateway.doors.routes import create_server
    from gateway.runtime import build_runtime

    runtime = build_runtime(load_cluster(backends))
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    if stack == "own":
        server = create_server(runtime, idle_s=75.0)
        await server.start(socket.create_server(("127.0.0.1", port), backlog=2048))
        await asyncio.Event().wait()
    routes = CompletionsDoor(runtime).routes()
    if stack == "uvicorn":
        import uvicorn

        config = uvicorn.Config(asgi_app(routes), host="127.0.0.1", port=port, http="httptools", loop="none",
                                lifespan="off", access_log=False, log_level="warning", backlog=2048)
        await uvicorn.Server(config).serve()
    elif stack == "granian":
        from granian.constants import Interfaces
        from granian.server.embed import Server

        await Server(RsgiApp(routes), address="127.0.0.1", port=port, interface=Interfaces.RSGI,
                     log_enabled=False, backlog=2048).serve()


def measure(url: str, pid: int, duration_s: float) -> dict[str, float]:
    row: dict[str, float] = {}
    for key, stream, tokens in (("", False, 4), ("_stream", True, 32)):
        before = loadgen.cpu_ticks(pid)
        r = loadgen.wrk(url + "/v1/chat/completions", 64, duration_s, body(tokens, stream))
        row[f"rps{key}"] = r.rps
        row[f"cpu_us_per_req{key}"] = (loadgen.cpu_ticks(pid) - before) / loadgen.CLK_TCK / max(1, r.requests) * 1e6
        row[f"errors{key}"] = r.errors
        if not stream:
            row["p50_ms"], row["p99_ms"] = r.p50_us / 1000, r.p99_us / 1000
    return row


def summarise(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        row = {k: statistics.median(r[name][k] for r in rounds) for k in rounds[0][name]}
        for key in ("", "_stream"):
            row[f"cpu_ratio{key}"] = statistics.median(
                r[name][f"cpu_us_per_req{key}"] / r["own"][f"cpu_us_per_req{key}"] for r in rounds)
        out[name] = row
    return out


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print("| stack | req/s c=64 | CPU µs/req | CPU vs own | p50 ms | p99 ms | req/s c=64 stream | "
          "CPU µs/req stream | CPU vs own stream | errors |")
    print("|---|" + "---:|" * 9)
    for name, r in summary.items():
        print(f"| {name} | {r['rps']:,.0f} | {r['cpu_us_per_req']:,.0f} | {r['cpu_ratio']:.2f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['rps_stream']:,.0f} | {r['cpu_us_per_req_stream']:,.0f} | "
              f"{r['cpu_ratio_stream']:.2f} | {r['errors'] + r['errors_stream']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run")
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    p.add_argument("--backends", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        from common.event_loop import run

        run(serve(args.serve, args.backends, args.port))
        return 0
    stacks = args.stacks.split(",")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        urls = mock_engines(stack, tmp)
        config = openai_config(tmp, urls)
        servers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        for name in stacks:
            port = free_port()
            proc = stack.enter_context(process(
                [sys.executable, __file__, "--serve", name, "--backends", str(config), "--port", str(port)],
                tmp / f"{name}.log"))
            wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", proc)
            servers[name] = (f"http://127.0.0.1:{port}", proc)
        rounds = []
        for i in range(args.rounds):
            order = stacks[i % len(stacks):] + stacks[:i % len(stacks)]
            row = {}
            for name in order:
                print(f"round {i + 1}/{args.rounds}: {name}", flush=True)
                url, proc = servers[name]
                row[name] = measure(url, proc.pid, args.duration)
            rounds.append({name: row[name] for name in stacks})
    summary = summarise(rounds)
    print_table(summary)
    versions = {name: _version(name) for name in ("uvicorn", "httptools", "uvloop", "granian")}
    save_report(args.out, {"wall_s": time.monotonic() - started, "git": git_state(), "duration_s": args.duration,
                           "versions": versions, "summary": summary, "rounds": rounds})
    return 0


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    raise SystemExit(main())
