"""Closed-loop load on engines' gRPC Generate with a Python grpc.aio client; prints one JSON line.

    python benchmarks/grpc_load.py --concurrency 16 --duration 3 [--max-tokens 4] ADDRESS [ADDRESS ...]

`concurrency` workers share one channel per address (workers spread round-robin over the
addresses), as the gateway holds one channel per engine. Each worker sends GenerateRequest after
GenerateRequest until the duration is over, reads the whole stream, and records the wall time
from the call to the last chunk (time.perf_counter). A stream that does not end with a
finish_reason counts as an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc
import uvloop

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import percentile  # noqa: E402
from common.wire import engine_pb2, engine_pb2_grpc  # noqa: E402

PROMPT = "user: Hello there, how are you?"


def generate_request(request_id: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    """What the gateway sends for the benchmark's chat body (same prompt rendering and token count)."""
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt=PROMPT, prompt_tokens=11, max_tokens=max_tokens, temperature=1.0,
        embedding_timeout_ms=10_000,
    )


async def load(addresses: list[str], concurrency: int, duration_s: float, max_tokens: int) -> dict[str, float]:
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [engine_pb2_grpc.EngineStub(c) for c in channels]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration_s

    async def worker(w: int) -> None:
        nonlocal errors
        stub = stubs[w % len(stubs)]
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            request = generate_request(f"direct-{w}-{i}", max_tokens)
            t0 = time.perf_counter()
            finish = ""
            try:
                async for chunk in stub.Generate(request, timeout=30):
                    finish = chunk.finish_reason
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            if finish:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await asyncio.gather(*(c.close() for c in channels))
    us = sorted(x * 1e6 for x in latencies)
    return {
        "requests": len(us), "errors": errors, "duration_s": elapsed, "rps": len(us) / elapsed, "cpu_s": cpu,
        "p50_us": percentile(us, 50), "p99_us": percentile(us, 99), "mean_us": sum(us) / max(1, len(us)),
    }


async def _main(args: argparse.Namespace) -> None:
    result = await load(args.addresses, args.concurrency, args.duration, args.max_tokens)
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("addresses", nargs="+", help="host:port of each engine")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=3.0, help="seconds (the run stops issuing after this)")
    p.add_argument("--max-tokens", type=int, default=4)
    uvloop.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    main()
