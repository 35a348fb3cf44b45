"""`gateway --workers`: req/s and added latency of 1 and 2 worker processes, in one run.

    python benchmarks/workers.py [--quick] [--rounds 2] [--duration 4] [--redis-url redis://127.0.0.1:6379/0]

Targets, each in front of the same two mock OpenAI engines (benchmarks/mock_openai_engine.py) as
`kind: openai` backends, measured with the front-door benchmark's cells (benchmarks/front_door.py:
wrk at c=64 non-streamed and streamed, p50/p99 at c=1 and c=16 minus the direct path, TTFT):

    direct               wrk straight to one mock engine (the floor)
    1-worker             one gateway process, state in memory
    1-worker+redis       one gateway process sharing state through Redis (the refresh loop's cost)
    2-workers+redis      `gateway --workers 2`: two processes on the same ports (SO_REUSEPORT)

CPU per request is left out for the worker targets (the parent process does no work). Also times
one shared-state refresh (the pipelined round trip every replica makes every `refresh_ms`) for the
demo cluster's 10 backends with 3 replicas publishing. Writes benchmarks/results/workers.json and
prints the tables that docs/REPLICAS.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from benchmarks.front_door import (  # noqa: E402
    MODEL,
    Target,
    mock_engines,
    print_table,
    run_rounds,
    summarise,
    wait_http,
)
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from gateway.config.cluster import load_cluster  # noqa: E402
from gateway.replicas.shared_state import SharedState, connect  # noqa: E402
from gateway.runtime import build_runtime  # noqa: E402
from testkit.harness import run_gateway, write_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "workers.json"


def start_targets(stack: ExitStack, tmp: Path, redis_url: str, prefix: str) -> list[Target]:
    urls = mock_engines(stack, tmp)
    targets = [Target("direct", urls[0], 0)]
    for name, extra in (("1-worker", []), ("1-worker+redis", ["--redis-url", redis_url]),
                        ("2-workers+redis", ["--workers", "2", "--redis-url", redis_url])):
        d = tmp / name
        d.mkdir()
        config = write_config(d, {
            "model": "llava-1.5-7b", "served_model_name": MODEL,
            "gateway": {"redis": {"key_prefix": f"{prefix}{name}:"}},
            "backends": [{"id": f"up{i}", "kind": "openai", "role": "language", "gpu": "H100", "address": u}
                         for i, u in enumerate(urls)],
        })
        gw = stack.enter_context(run_gateway(config, *extra, healthy=0))
        wait_http(f"{gw.url}/v1/chat/completions", gw.process)
        targets.append(Target(name, gw.url, 0 if "--workers" in extra else gw.process.pid))
    return targets


async def refresh_ms(redis_url: str, prefix: str, n: int = 500) -> float:
    """Mean wall time of one refresh of replica 0 while two more replicas publish (ms)."""
    config = load_cluster()
    settings = config.settings.redis.model_copy(update={"key_prefix": prefix + "refresh:"})
    runtimes = [build_runtime(config) for _ in range(3)]
    clients = [connect(settings, redis_url) for _ in runtimes]
    states = [SharedState(rt.table, client, settings, f"bench-{i}")
              for i, (rt, client) in enumerate(zip(runtimes, clients, strict=True))]
    try:
        for _ in range(3):
            for s in states:
                await s.refresh()
        t0 = time.perf_counter()
        for _ in range(n):
            await states[0].refresh()
        return (time.perf_counter() - t0) / n * 1000
    finally:
        for s, rt, client in zip(states, runtimes, clients, strict=True):
            await s.withdraw()
            await client.aclose()
            await rt.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run")
    p.add_argument("--quick", action="store_true", help="1 round of 2 s runs")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = p.parse_args(argv)
    rounds, duration = (1, 2.0) if args.quick else (args.rounds, args.duration)
    prefix = f"hgbench:{uuid.uuid4().hex[:8]}:"
    started = time.monotonic()
    runs: list[dict[str, dict[str, Any]]] = []
    try:
        refresh = asyncio.run(refresh_ms(args.redis_url, prefix))
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            targets = start_targets(stack, Path(tmp), args.redis_url, prefix)
            runs = run_rounds(targets, rounds, duration, 50 if args.quick else 200)
    finally:
        with redis.Redis.from_url(args.redis_url, socket_timeout=2) as r:
            keys = list(r.scan_iter(match=prefix + "*"))
            if keys:
                r.delete(*keys)
    summary = summarise(runs)
    print_table(summary)
    print(f"\nshared-state refresh, 10 backends, 3 replicas: {refresh:.3f} ms per round trip")
    save_report(RESULTS, {"refresh_ms": refresh, "wall_s": time.monotonic() - started, "rounds": rounds,
                          "duration_s": duration, "cpus": os.cpu_count(), "git": git_state(), "summary": summary,
                          "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
