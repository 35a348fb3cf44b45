"""Route-and-reserve against the snapshot mode: herding distance, and what a Redis round trip per
request costs. Measured to decide whether replicas should decide in Redis; they do not (docs/REPLICAS.md).

    flock /tmp/heterogate-heavy.lock python benchmarks/route_and_reserve.py [--seeds 1 5] [--calls 3000]

Route-and-reserve: one Lua script per request picks the cheapest backend by `heteroserve`'s cost
with every replica's in-flight count as of that instant and books the request there, atomically, in
one round trip; a completion takes it back (a second call). The script needs the cost as a function
of the queue it reads, cost_i = base_i + max(Q_i, reported_i) · T̄_i with base_i = prefill + veto
terms computed by the replica, so it holds for policies linear in Q_i only (heteroserve), not for
every policy the snapshot mode serves (the spreading layer is policy-agnostic). The global count is
one hash `P reserved`; a production version would also need per-replica counts with expiry, as the
snapshot mode has, so that a dead replica's bookings do not stay.

1. Herding (testkit/herding.py, the test's setup: 3 replicas vs 1, 25 req/s for 90 s over
   1×H100, 2×A100, 2×L40S, seeded): L1 distance of per-backend shares to the single gateway's for
   the snapshot mode (shared + spreading, the default) and route-and-reserve (heartbeats shared the
   same way; the decision made in Redis). Also route-and-reserve with one replica (must be 0: the
   script computes the policy's own costs).
2. Cost on the request path, on this machine's Redis: per request, the pick (EVALSHA, 8 candidates)
   and the release (HINCRBY) from one asyncio client at concurrency 1 and 16: latency of the pick,
   client CPU and Redis CPU per request, beside the in-process decision the snapshot mode makes.

Writes benchmarks/results/route_and_reserve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from benchmarks import loadgen  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from benchmarks.mixed_tier import CLUSTER  # noqa: E402
from common.catalog import load_catalog  # noqa: E402
from gateway.routing.backend_entry import Reported  # noqa: E402
from gateway.routing.policies import build_policy  # noqa: E402
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile  # noqa: E402
from gateway.routing.state_table import StateTable  # noqa: E402
from testkit.herding import l1, route_trace, seeded_trace, shares  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "route_and_reserve.json"
REDIS_URL = "redis://127.0.0.1:6379/0"
TIMEOUT_S = 1.0

# KEYS[1]: P reserved (backend -> requests in flight, all replicas). ARGV: per candidate, in order:
# id, base cost (s), T̄_service (s), engine-reported waiting + running. Ties: the first, as heteroserve.
RESERVE_LUA = """
local best, best_cost = nil, nil
for i = 1, #ARGV, 4 do
  local q = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  local floor = tonumber(ARGV[i + 3])
  if floor > q then q = floor end
  local cost = tonumber(ARGV[i + 1]) + q * tonumber(ARGV[i + 2])
  if best_cost == nil or cost < best_cost then best, best_cost = ARGV[i], cost end
end
redis.call('HINCRBY', KEYS[1], best, 1)
return best
"""


class Reserve:
    """Decide and book in Redis, one EVALSHA per request; release with HINCRBY -1."""

    def __init__(self, redis: Redis, key: str) -> None:
        self._redis = redis
        self._key = key
        self._script = redis.register_script(RESERVE_LUA)

    async def pick(self, decision: Decision, candidates: Sequence[BackendSnapshot], table: StateTable) -> str:
        args: list[str | float | int] = []
        for c, terms in zip(candidates, decision.costs, strict=True):
            entry = table.get(c.id)
            floor = entry.reported.waiting + entry.reported.running if entry is not None else 0
            args += [c.id, repr(terms.prefill + terms.oom), repr(c.mean_service_s), floor]
        return str(await asyncio.wait_for(self._script(keys=[self._key], args=args), TIMEOUT_S))

    async def release(self, backend_id: str) -> None:
        await asyncio.wait_for(self._redis.hincrby(self._key, backend_id, -1), TIMEOUT_S)


async def cleanup(redis: Redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(match=prefix + "*")]
    if keys:
        await redis.delete(*keys)


async def herding(seeds: range, redis: Redis) -> list[dict[str, Any]]:
    rows = []
    for seed in seeds:
        trace = seeded_trace(seed, 25.0, 90.0)
        single = shares(await route_trace(trace, "single", 1))
        row: dict[str, Any] = {"seed": seed, "requests": len(trace.arrivals)}
        for name, mode, n, reserve in (("snapshot", "shared", 3, False), ("reserve", "shared_no_spread", 3, True),
                                       ("reserve_1_replica", "single", 1, True)):
            prefix = f"hgreserve:{uuid.uuid4().hex[:8]}:"
            router = Reserve(redis, prefix + "reserved") if reserve else None
            try:
                counts = await route_trace(trace, mode, n, prefix=prefix, redis_url=REDIS_URL,  # type: ignore[arg-type]
                                           router=router)
            finally:
                await cleanup(redis, prefix)
            row[name] = l1(shares(counts), single)
        print(f"seed {seed}: snapshot {row['snapshot']:.3f}  reserve {row['reserve']:.3f}  "
              f"reserve, 1 replica {row['reserve_1_replica']:.3f}", flush=True)
        rows.append(row)
    return rows


def mixed_table() -> tuple[StateTable, list[BackendSnapshot]]:
    """mixed_tier's eight backends with a little load reported on each."""
    cat = load_catalog()
    table = StateTable(cat.model("llava-1.5-7b"), 0.2, 3)
    for i, (backend_id, gpu) in enumerate(CLUSTER):
        table.register(backend_id, "language", cat.gpu(gpu), address=None, managed=False)
        table.apply_heartbeat(backend_id, 1, backend_id, Reported(seq=1, waiting=i % 3, running=2 + i % 4,
                                                                  kv_free_bytes=1 << 40, kv_total_bytes=1 << 40))
    return table, list(table.candidates(("language",)))


def redis_cpu_s(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def request_path(redis: Redis, calls: int) -> dict[str, Any]:
    table, candidates = mixed_table()
    policy = build_policy("heteroserve")
    profile = RequestProfile("r", 700, 64)
    started = time.perf_counter()
    for _ in range(calls):
        policy.choose(profile, candidates, 0.0)
    local_us = (time.perf_counter() - started) / calls * 1e6
    out: dict[str, Any] = {"snapshot_decision_us": local_us}
    prefix = f"hgreserve:{uuid.uuid4().hex[:8]}:"
    reserve = Reserve(redis, prefix + "reserved")

    async def worker(n: int, latencies: list[float]) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            backend_id = await reserve.pick(policy.choose(profile, candidates, 0.0), candidates, table)
            latencies.append(time.perf_counter() - t0)
            await reserve.release(backend_id)

    try:
        await worker(50, [])   # warm: script loaded, a connection open
        for concurrency in (1, 16):
            latencies: list[float] = []
            cpu0, info0, t0 = time.process_time(), await redis.info("cpu"), time.perf_counter()
            await asyncio.gather(*(worker(calls // concurrency, latencies) for _ in range(concurrency)))
            wall = time.perf_counter() - t0
            cpu1, info1 = time.process_time(), await redis.info("cpu")
            n = len(latencies)
            latencies.sort()
            out[f"c{concurrency}"] = {
                "requests": n, "pick_p50_us": loadgen.percentile(latencies, 50) * 1e6,
                "pick_p99_us": loadgen.percentile(latencies, 99) * 1e6,
                "client_cpu_us_per_req": (cpu1 - cpu0) / n * 1e6,
                "redis_cpu_us_per_req": (redis_cpu_s(info1) - redis_cpu_s(info0)) / n * 1e6,
                "req_per_s": n / wall,
            }
    finally:
        await cleanup(redis, prefix)
    return out


async def run(seeds: range, calls: int) -> dict[str, Any]:
    redis = Redis.from_url(REDIS_URL, decode_responses=True, socket_timeout=TIMEOUT_S)
    try:
        rows = await herding(seeds, redis)
        path = await request_path(redis, calls)
    finally:
        await redis.aclose()
    return {"herding": rows, "request_path": path}


def main(argv: list[str] | None = None) -> int:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seeds", type=int, nargs=2, default=[1, 5], metavar=("FIRST", "LAST"))
    p.add_argument("--calls", type=int, default=3000, help="requests per concurrency level")
    args = p.parse_args(argv)
    started = time.monotonic()
    result = asyncio.run(run(range(args.seeds[0], args.seeds[1] + 1), args.calls))
    rows = result["herding"]
    print("\n| seed | requests | snapshot (shared + spreading) | route-and-reserve | route-and-reserve, 1 replica |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['requests']} | {r['snapshot']:.3f} | {r['reserve']:.3f} | "
              f"{r['reserve_1_replica']:.3f} |")
    print(f"| mean | | {statistics.mean(r['snapshot'] for r in rows):.3f} | "
          f"{statistics.mean(r['reserve'] for r in rows):.3f} | |")
    path = result["request_path"]
    print(f"\nsnapshot mode: in-process decision {path['snapshot_decision_us']:.1f} µs, no Redis call\n")
    print("| route-and-reserve | pick p50 µs | pick p99 µs | client CPU µs/req | Redis CPU µs/req | req/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in ("c1", "c16"):
        x = path[c]
        print(f"| concurrency {c[1:]} | {x['pick_p50_us']:.0f} | {x['pick_p99_us']:.0f} | "
              f"{x['client_cpu_us_per_req']:.0f} | {x['redis_cpu_us_per_req']:.0f} | {x['req_per_s']:.0f} |")
    save_report(RESULTS, {"wall_s": time.monotonic() - started, "git": git_state(), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
