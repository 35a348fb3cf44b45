"""Several gateway replicas routing one seeded trace over a mixed-tier cluster, in virtual time.

Each replica is what a gateway process holds for routing: a real state table, the real policy objects
(with the spreading layer when sharing) and, when sharing, a real `SharedState` refreshing through the
real Redis every `refresh_s` of virtual time. The engines are a small model: a request holds its
backend for its performance-model service time, stretched by 5 % per other request running there
(continuous batching); every engine heartbeats its running count every `heartbeat_s` to one replica
(sharing: the others learn it through Redis) or to every replica (isolated: no Redis, each replica
on its own view). Requests reach the replicas in turn, like a round-robin load balancer.

A `router` (benchmarks/route_and_reserve.py) may replace each replica's own choice with an atomic
decision in Redis; it sees the policy's decision and the candidates, and releases on completion.

Virtual time keeps the run short and the event order reproducible; only Redis is real (its TTLs run
in real time, far longer than a run's real duration).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from common import perf_model
from common.catalog import load_catalog
from gateway.config.sections import RedisConfig
from gateway.replicas.shared_state import SharedState, connect
from gateway.routing.backend_entry import Reported
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import BackendSnapshot, Decision, Policy, RequestProfile
from gateway.routing.policies.spreading import Spreading
from gateway.routing.signals import LocalSignals, SignalStore
from gateway.routing.state_table import StateTable

Mode = Literal["single", "shared", "shared_no_spread", "isolated"]
CLUSTER = {"H100": 1, "A100-80GB": 2, "L40S": 2}    # three tiers
BATCH_STRETCH = 0.05


class Router(Protocol):
    async def pick(self, decision: Decision, candidates: Sequence[BackendSnapshot], table: StateTable) -> str: ...
    async def release(self, backend_id: str) -> None: ...


@dataclass(frozen=True)
class Trace:
    arrivals: list[tuple[float, int, int]]   # (time s, prompt tokens, output tokens)


def seeded_trace(seed: int, rate_per_s: float, duration_s: float) -> Trace:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return Trace(out)
        out.append((t, int(rng.lognormvariate(6.0, 0.7)) + 16, int(rng.lognormvariate(4.5, 0.6)) + 8))


def shares(counts: Counter[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def l1(a: dict[str, float], b: dict[str, float]) -> float:
    return sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


async def route_trace(
    trace: Trace, mode: Mode, replicas: int, *, prefix: str = "unused:", redis_url: str = "",
    policy: str = "heteroserve", refresh_s: float = 0.05, heartbeat_s: float = 0.2, spread: float = 0.05,
    router: Router | None = None,
) -> Counter[str]:
    """Per-backend request counts when `replicas` replicas route `trace` (mode `single`: one, bare policy)."""
    cat = load_catalog()
    model = cat.model("llava-1.5-7b")
    gpus = {f"{g.lower()}-{i}": cat.gpu(g) for g, n in CLUSTER.items() for i in range(n)}
    ids = list(gpus)
    clock = [0.0]
    sharing = mode in ("shared", "shared_no_spread")
    tables, policies, shared = [], [], []
    config = RedisConfig(url=redis_url, key_prefix=prefix, refresh_ms=max(1, round(refresh_s * 1000)),
                         replica_ttl_ms=60_000, spread=spread, timeout_ms=5000)
    clients = []
    for r in range(replicas):
        t = StateTable(model, heartbeat_s, 3, clock=lambda: clock[0])
        for backend_id, gpu in gpus.items():
            t.register(backend_id, "language", gpu, address=None, managed=False)
        p: Policy = build_policy(policy)
        if mode == "shared":
            p = Spreading(p, spread, seed=f"replica-{r}")
        tables.append(t)
        policies.append(p)
        if sharing:
            client = connect(config, redis_url)
            clients.append(client)
            shared.append(SharedState(t, client, config, f"replica-{r}"))
    stores: list[SignalStore] = [*shared] if sharing else [LocalSignals(t) for t in tables]
    running = dict.fromkeys(ids, 0)
    seq = [0]
    counts: Counter[str] = Counter()
    # events: (time, order, kind, payload); kinds sort heartbeats/refreshes before arrivals at one instant
    events: list[tuple[float, int, str, object]] = []
    order = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, payload))

    for i, (at, prompt, output) in enumerate(trace.arrivals):
        push(at, "arrive", (i, prompt, output))
    end = trace.arrivals[-1][0]
    k = 0
    while k * heartbeat_s <= end:
        push(k * heartbeat_s, "heartbeat", None)
        k += 1
    if sharing:
        k = 0
        while k * refresh_s <= end:
            push(k * refresh_s + 1e-6, "refresh", None)
            k += 1
    try:
        while events:
            at, _, kind, payload = heapq.heappop(events)
            clock[0] = at
            if kind == "heartbeat":
                seq[0] += 1
                for j, backend_id in enumerate(ids):
                    reported = Reported(seq=seq[0], running=running[backend_id], kv_free_bytes=1 << 40,
                                        kv_total_bytes=1 << 40)
                    targets = [j % replicas] if sharing else range(replicas)
                    for r in targets:
                        stores[r].heartbeat(backend_id, seq[0], backend_id, reported)
            elif kind == "refresh":
                for s in shared:
                    await s.refresh()
            elif kind == "arrive":
                i, prompt, output = payload  # type: ignore[misc]
                r = i % replicas
                profile = RequestProfile(f"r{i}", prompt, output)
                candidates = tables[r].candidates(("language",), at)
                decision = policies[r].choose(profile, candidates, at)
                backend_id = decision.backend.id
                if router is not None:
                    backend_id = await router.pick(decision, candidates, tables[r])
                lease = tables[r].acquire(backend_id)
                counts[backend_id] += 1
                base = perf_model.service_seconds(model, gpus[backend_id], prompt, output)
                push(at + base * (1 + BATCH_STRETCH * running[backend_id]), "done", (r, lease))
                running[backend_id] += 1
            else:
                r, lease = payload  # type: ignore[misc]
                tables[r].release(lease)
                running[lease.backend_id] -= 1
                if router is not None:
                    await router.release(lease.backend_id)
    finally:
        for s in shared:
            await s.withdraw()
        for c in clients:
            await c.aclose()
    return counts


async def _table(seeds: range, rate: float, duration_s: float, redis_url: str) -> None:
    import uuid

    import redis.asyncio as aioredis

    print("| seed | requests | isolated | shared, no spreading | shared + spreading |")
    print("|---:|---:|---:|---:|---:|")
    for seed in seeds:
        trace = seeded_trace(seed, rate, duration_s)
        single = shares(await route_trace(trace, "single", 1))
        cells = [l1(shares(await route_trace(trace, "isolated", 3)), single)]
        for mode in ("shared_no_spread", "shared"):
            prefix = f"hgherding:{uuid.uuid4().hex[:8]}:"
            try:
                counts = await route_trace(trace, mode, 3, prefix=prefix, redis_url=redis_url)  # type: ignore[arg-type]
            finally:
                client = aioredis.Redis.from_url(redis_url)
                keys = [k async for k in client.scan_iter(match=prefix + "*")]
                if keys:
                    await client.delete(*keys)
                await client.aclose()
            cells.append(l1(shares(counts), single))
        print(f"| {seed} | {len(trace.arrivals)} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    # python -m testkit.herding [FIRST_SEED LAST_SEED]: the L1 distances of docs/REPLICAS.md
    import asyncio
    import logging
    import sys

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    first, last = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (1, 5)
    asyncio.run(_table(range(first, last + 1), 25.0, 90.0, "redis://127.0.0.1:6379/0"))
