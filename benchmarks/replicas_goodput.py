"""Goodput of one gateway against three replicas on one Redis, on the mixed-tier benchmark, in one run.

    flock /tmp/heterogate-heavy.lock python benchmarks/replicas_goodput.py [--rounds 3] [--requests 300]

The engines, workload, client and scoring are benchmarks/mixed_tier.py's (eight emulated engines:
2 x H100, 3 x A100-80GB, 3 x L40S; open-loop Poisson streaming chat requests; goodput = TTFT <= 2 s
and mean inter-token time <= 100 ms). Targets, each with the default policy and gateway-side scraping:

    1-gateway           one gateway process, no Redis
    1-gateway-again     a second one, the same: its distance to the first is the noise floor of the
                        comparison (arrival timing, learned speeds)
    3-replicas+redis    three gateway processes sharing state through the system Redis (fresh key prefix)
    3-replicas-isolated three gateway processes, no Redis: each routes on its own view (the herding case)

A run replays one request sequence, request i going to replica i mod 3 (a round-robin balancer).
Besides mixed_tier's figures, each row gives the L1 distance of its request shares to the single
gateway's in the same round and load, per tier and per engine (engines of one tier are alike, so the
per-engine distance is mostly which of them, the per-tier one is where the load went). Targets not
under test are paused (SIGSTOP); order alternates between rounds. Writes
benchmarks/results/replicas_goodput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import redis  # noqa: E402

from benchmarks import loadgen  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from benchmarks.mixed_tier import (  # noqa: E402
    CLUSTER,
    SETTLE_S,
    Outcome,
    Target,
    gateway_config,
    medians,
    one,
    paused,
    score,
    start_engines,
)
from benchmarks.mixed_workload import Request, trace  # noqa: E402
from testkit.harness import run_gateway, write_config  # noqa: E402
from testkit.herding import l1, shares  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "replicas_goodput.json"
REDIS_URL = "redis://127.0.0.1:6379/0"
TIERS_OF = dict(CLUSTER)


@dataclass
class Group:
    target: Target      # pids of every gateway process of the group (paused and resumed together)
    urls: list[str]


def start_group(stack: ExitStack, tmp: Path, engines: Any, name: str, n: int, prefix: str | None,
                spread: float | None = None) -> Group:
    urls, pids = [], []
    for i in range(n):
        where = tmp / f"{name}-{i}"
        where.mkdir()
        config = gateway_config(engines, scrape=True)
        extra: tuple[str, ...] = ()
        if prefix is not None:
            config["gateway"] = {"redis": {"key_prefix": prefix,
                                           **({} if spread is None else {"spread": spread})}}
            extra = ("--redis-url", REDIS_URL)
        gw = stack.enter_context(run_gateway(write_config(where, config), *extra))
        urls.append(gw.url)
        pids.append(gw.process.pid)
    return Group(Target(name, urls[0], pids), urls)


async def drive(urls: list[str], requests: list[Request]) -> list[Outcome]:
    """mixed_tier's open-loop client, request i sent to urls[i mod len(urls)]."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=120, connect=5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = loop.time()
        tasks = []
        for i, r in enumerate(requests):
            delay = start + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[i % len(urls)] + "/v1/chat/completions"
            tasks.append(asyncio.ensure_future(one(session, url, r)))
        return list(await asyncio.gather(*tasks))


def run_group(g: Group, requests: list[Request], time_scale: float) -> dict[str, Any]:
    g.target.signal(signal.SIGCONT)
    time.sleep(SETTLE_S)
    before, started = sum(loadgen.cpu_ticks(p) for p in g.target.pids), time.monotonic()
    outcomes = asyncio.run(drive(g.urls, requests))
    wall = time.monotonic() - started
    cpu = (sum(loadgen.cpu_ticks(p) for p in g.target.pids) - before) / loadgen.CLK_TCK
    g.target.signal(signal.SIGSTOP)
    return score(outcomes, time_scale) | {
        "engine_shares": shares(Counter(o.engine for o in outcomes if not o.error)),
        "tier_request_shares": shares(Counter(TIERS_OF.get(o.engine, "?") for o in outcomes if not o.error)),
        "router_cores": cpu / wall, "router_cpu_ms_per_req": cpu / len(requests) * 1000}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """target -> load -> medians over rounds (errors summed, tier shares averaged)."""
    return medians(runs, ("goodput", "ttft_p50_s", "ttft_p99_s", "l1_to_single", "l1_tiers", "router_cores"))


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| target | load | goodput | TTFT p50 / p99 s | L1 to 1 gateway: tiers / engines "
             "| tier shares H100 / A100 / L40S | errors | router cores | rounds |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for target, cells in summary.items():
        for load, c in cells.items():
            shares = " / ".join(f"{c['tier_shares'].get(t, 0.0):.0%}" for t in ("H100", "A100-80GB", "L40S"))
            lines.append(f"| {target} | {load} | {c['goodput']:.1%} | {c['ttft_p50_s']:.2f} / {c['ttft_p99_s']:.2f} "
                         f"| {c['l1_tiers']:.3f} / {c['l1_to_single']:.3f} | {shares} | {c['errors']} "
                         f"| {c['router_cores']:.2f} | {c['rounds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=300, help="requests per run")
    p.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.9], help="fractions of capacity")
    p.add_argument("--time-scale", type=float, default=1.0, help="emulated seconds per real second")
    p.add_argument("--spread", type=float, help="gateway.redis.spread of the replicas on Redis (default: its default)")
    args = p.parse_args(argv)
    started = time.monotonic()
    prefix = f"hgbench:replicas:{uuid.uuid4().hex[:8]}:"
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            engines = start_engines(stack, Path(tmp), args.time_scale)
            capacity = sum(engines.rates.values())
            groups = [start_group(stack, Path(tmp), engines, "1-gateway", 1, None),
                      start_group(stack, Path(tmp), engines, "1-gateway-again", 1, None),
                      start_group(stack, Path(tmp), engines, "3-replicas+redis", 3, prefix, args.spread),
                      start_group(stack, Path(tmp), engines, "3-replicas-isolated", 3, None)]
            print(f"capacity {capacity:.1f} req/s", flush=True)
            with paused([g.target for g in groups]):
                for i in range(args.rounds):
                    order = groups if i % 2 == 0 else groups[::-1]
                    for load in args.loads:
                        requests = trace(args.requests, load * capacity, seed=1000 * i + int(load * 100))
                        rows = {g.target.name: run_group(g, requests, args.time_scale) for g in order}
                        single = rows["1-gateway"]
                        for name, row in rows.items():
                            row.update(target=name, load=f"{load}x", round=i,
                                       l1_to_single=l1(row["engine_shares"], single["engine_shares"]),
                                       l1_tiers=l1(row["tier_request_shares"], single["tier_request_shares"]))
                            runs.append(row)
                            print(f"round {i + 1}/{args.rounds} {load}x {name}: goodput {row['goodput']:.1%} "
                                  f"ttft p99 {row['ttft_p99_s']:.2f} s L1 tiers {row['l1_tiers']:.3f} "
                                  f"errors {row['errors']}", flush=True)
    finally:
        with redis.Redis.from_url(REDIS_URL, socket_timeout=2) as r:
            keys = list(r.scan_iter(match=prefix + "*", count=1000))
            if keys:
                r.delete(*keys)
    order_names = [g.target.name for g in groups]
    summary = summarise(runs)
    summary = {name: summary[name] for name in order_names if name in summary}
    text = table(summary)
    print(text)
    save_report(RESULTS, {
        "wall_s": time.monotonic() - started, "rounds": args.rounds, "requests_per_run": args.requests,
        "loads": args.loads, "time_scale": args.time_scale, "spread": args.spread, "capacity_rps": capacity,
        "cluster": CLUSTER,
        "git": git_state(), "table": text, "summary": summary, "runs": runs,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
