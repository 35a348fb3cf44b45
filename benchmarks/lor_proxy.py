"""A ~100-line OpenAI proxy with the classic load balancers, the baselines of benchmarks/mixed_tier.py.

    python benchmarks/lor_proxy.py --port 9000 --policy cwlor --backend http://127.0.0.1:9101=12.5 ...

    rr      round robin
    lor     least outstanding requests (requests this proxy sent and that have not finished)
    cwlor   capacity-weighted least outstanding: argmin (outstanding_i + 1) / weight_i, weight_i given
            on the command line (the benchmark passes each engine's measured saturated rate)

Streams the upstream body through as it arrives (aiohttp on uvloop).
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web


class Balancer:
    def __init__(self, policy: str, backends: list[tuple[str, float]]) -> None:
        self.policy = policy
        self.urls = [u for u, _ in backends]
        self.weights = [w for _, w in backends]
        self.outstanding = [0] * len(backends)
        self._rr = itertools.cycle(range(len(backends)))

    def pick(self) -> int:
        if self.policy == "rr":
            return next(self._rr)
        if self.policy == "lor":
            return min(range(len(self.urls)), key=self.outstanding.__getitem__)
        return min(range(len(self.urls)), key=lambda i: (self.outstanding[i] + 1) / self.weights[i])


def make_app(balancer: Balancer) -> web.Application:
    session: aiohttp.ClientSession | None = None

    async def start(app: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=600, connect=5))

    async def stop(app: web.Application) -> None:
        if session is not None:
            await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        body = await request.read()
        i = balancer.pick()
        balancer.outstanding[i] += 1
        try:
            async with session.post(balancer.urls[i] + request.path, data=body,
                                    headers={"content-type": "application/json"}) as up:
                out = web.StreamResponse(status=up.status,
                                         headers={"content-type": up.headers.get("content-type", "application/json")})
                await out.prepare(request)
                async for data in up.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"upstream: {exc}", "code": 502}}, status=502)
        finally:
            balancer.outstanding[i] -= 1

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/health", health)
    return app


def parse_backend(text: str) -> tuple[str, float]:
    url, _, weight = text.partition("=")
    return url.rstrip("/"), float(weight or 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--policy", choices=["rr", "lor", "cwlor"], required=True)
    p.add_argument("--backend", type=parse_backend, action="append", required=True, help="URL[=weight]")
    args = p.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(Balancer(args.policy, args.backend)), host="127.0.0.1", port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
