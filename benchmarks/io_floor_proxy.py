"""The I/O floor of the front door: the gateway's own HTTP server and upstream client, and nothing else.

    python benchmarks/io_floor_proxy.py --port 9200 http://127.0.0.1:9101 http://127.0.0.1:9102

POST /v1/chat/completions and /v1/completions are forwarded to the upstreams in turn, the client's
body as it came, and the upstream's status and body relayed as they come (streamed when the upstream
streams). No parsing, validation, routing, admission, leases, retries, metrics or logs: what this
process spends per request is what `gateway.doors.http_server` and `gateway.clients.upstream_http` cost on this
machine, so that `benchmarks/front_door.py` can show how much of the gateway's CPU per request is
its I/O and how much its own logic. Not a product: it has no error handling beyond a 502.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from common.event_loop import run  # noqa: E402
from gateway.clients.upstream_http import UpstreamPool  # noqa: E402
from gateway.doors.http_server import Exchange, HttpServer, Request  # noqa: E402
from gateway.replicas.workers import reuse_port_socket  # noqa: E402

_SSE = [(b"content-type", b"text/event-stream")]
_HEADERS = (("content-type", "application/json"),)


async def serve(port: int, upstreams: list[str]) -> None:
    pools = itertools.cycle([UpstreamPool(u, max_connections=512, idle_s=300.0) for u in upstreams])

    async def forward(request: Request, exchange: Exchange, *, path: str) -> None:
        try:
            resp = await next(pools).post(path, request.body, _HEADERS, connect_timeout_s=5.0)
        except OSError:
            exchange.respond(502, [], b'{"error":{"message":"upstream unreachable"}}')
            return
        try:
            streamed = not any(name == b"content-length" for name, _ in resp.headers)
            if not streamed:
                exchange.respond(resp.status, [], await resp.read())
                return
            exchange.start_stream(resp.status, _SSE)
            while data := await resp.read_some():
                exchange.send(data)
                await exchange.drain()
            exchange.end_stream(b"")
        finally:
            resp.release()

    async def not_found(request: Request, exchange: Exchange) -> None:
        raise RuntimeError("only the completion routes are served")

    routes = {path: functools.partial(forward, path=path) for path in ("/v1/chat/completions", "/v1/completions")}
    server = HttpServer(routes, not_found, max_body_bytes=1 << 20, idle_s=300.0,   # type: ignore[arg-type]
                        body_timeout_s=60.0)
    await server.start(reuse_port_socket("127.0.0.1", port))
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstreams", nargs="+", help="base URLs of the engines, e.g. http://127.0.0.1:9101")
    args = p.parse_args(argv)
    run(serve(args.port, args.upstreams))


if __name__ == "__main__":
    main()
