"""CPU per request of the upstream HTTP client: aiohttp's ClientSession against gateway.clients.upstream_http.

    python benchmarks/upstream_client.py [--requests 6000] [--concurrency 64] [--rounds 3]

Both clients post the same non-streamed chat completion to one mock OpenAI engine on loopback
(benchmarks/mock_openai_engine.py, its own process), `--concurrency` requests at a time on uvloop, and
read the JSON reply; CPU is this process's (time.process_time), so the engine's CPU is not counted.
Clients alternate within each round; cells are medians over rounds. Writes
benchmarks/results/upstream_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import uvloop  # noqa: E402

from benchmarks.front_door import body, process, wait_http  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from gateway.clients.upstream_http import UpstreamPool  # noqa: E402
from testkit.harness import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "upstream_client.json"
PATH = "/v1/chat/completions"
HEADERS = (("content-type", "application/json"), ("x-request-id", "bench"))
Post = Callable[[], Awaitable[None]]


async def timed(post: Post, requests: int, concurrency: int) -> dict[str, float]:
    async def worker(n: int) -> None:
        for _ in range(n):
            await post()

    await asyncio.gather(*(worker(10) for _ in range(concurrency)))   # warm-up: connections open
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    done = requests // concurrency * concurrency
    return {"cpu_us_per_req": (time.process_time() - cpu) / done * 1e6, "rps": done / (time.perf_counter() - wall)}


async def with_aiohttp(url: str, payload: bytes, requests: int, concurrency: int) -> dict[str, float]:
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=4.0), trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None), skip_auto_headers=("User-Agent",),
    ) as session:
        async def post() -> None:
            async with session.post(url + PATH, data=payload, headers=dict(HEADERS)) as resp:
                orjson.loads(await resp.read())

        return await timed(post, requests, concurrency)


async def with_lean(url: str, payload: bytes, requests: int, concurrency: int) -> dict[str, float]:
    pool = UpstreamPool(url, max_connections=1024, idle_s=4.0)

    async def post() -> None:
        resp = await pool.post(PATH, payload, HEADERS, connect_timeout_s=5.0)
        try:
            orjson.loads(await resp.read())
        finally:
            resp.release()

    try:
        return await timed(post, requests, concurrency)
    finally:
        await pool.close()


CLIENTS: dict[str, Callable[[str, bytes, int, int], Awaitable[dict[str, float]]]] = {
    "aiohttp": with_aiohttp, "upstream_http": with_lean,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=6000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    started = time.monotonic()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    payload = body(4, False)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CLIENTS}
    with process([sys.executable, str(ROOT / "benchmarks" / "mock_openai_engine.py"), "--port", str(port)],
                 Path("/dev/null")) as proc:
        wait_http(url + PATH, proc)
        for i in range(args.rounds):
            names = list(CLIENTS) if i % 2 == 0 else list(CLIENTS)[::-1]
            for name in names:
                runs[name].append(uvloop.run(CLIENTS[name](url, payload, args.requests, args.concurrency)))
    summary: dict[str, Any] = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    print(f"| client | CPU µs/request | req/s (c={args.concurrency}) |\n|---|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['cpu_us_per_req']:.1f} | {row['rps']:,.0f} |")
    save_report(RESULTS, {"git": git_state(), "args": vars(args), "summary": summary, "runs": runs,
                          "wall_s": time.monotonic() - started})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
