"""A tenant's tokens-per-minute limit held by three replicas on one Redis: how much of it they admit.

    python -m benchmarks tenant-limit-replicas [--limit 20000] [--windows 2] [--concurrency 12] [--replicas 3]

Three gateway processes (`--redis-url`, one fresh key prefix) in front of one mock OpenAI upstream
(gateway/demo_upstream.py, scraped), each with the same tenant: `tokens_per_minute: --limit`. Closed-loop
clients send non-streamed chat requests of that tenant to the replicas in turn, far more than the limit
allows, for --windows whole minutes of Redis's clock (the limiter's windows, gateway/replicas/tenant_limits.py),
after the minute they start in. Per window, against the limit (target, issue 28: within 5%): the
tokens (prompt + completion, the upstream's usage) of the served requests that ended in it, and the
limiter's own count of the window as last read (Redis is read every 0.2 s); also the 429s. Prints a
table and writes benchmarks/results/tenant_limit_replicas.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from testkit.harness import Gateway, free_port, run_gateway, write_config  # noqa: E402

KEY, ADMIN = "team-key-1", "admin-key-1"
MESSAGE = "Tell me about the tiers of a mixed GPU cluster and how requests are routed. " * 4


@dataclass(frozen=True)
class Sent:
    at: float        # Redis time its answer came (local monotonic + offset)
    status: int
    tokens: int      # usage: prompt + completion (served requests)


def cluster(upstream: str, limit: int, prefix: str) -> dict[str, Any]:
    return {
        "model": "llava-1.5-7b",
        "gateway": {
            "heartbeat_interval_ms": 200,
            "auth": {"admin_keys_env": "BENCH_ADMIN_KEYS"},
            "redis": {"key_prefix": prefix},
            "tenants": {"teams": {"team": {"api_keys_env": "BENCH_TEAM_KEYS", "tokens_per_minute": limit}}},
        },
        "backends": [{"id": "up", "kind": "openai", "gpu": "H100", "address": upstream,
                      "scrape": {"engine": "vllm"}}],
    }


async def load(urls: list[str], concurrency: int, until: float, offset: float) -> list[Sent]:
    """Closed-loop clients, request i to replica i mod len(urls), until Redis time `until`."""
    out: list[Sent] = []
    turn = itertools.count()
    body = {"model": "llava-1.5-7b", "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 24}
    headers = {"authorization": f"Bearer {KEY}"}

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() + offset < until:
            url = urls[next(turn) % len(urls)]
            resp = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            usage = resp.json().get("usage") or {} if resp.status_code == 200 else {}
            out.append(Sent(time.monotonic() + offset, resp.status_code, int(usage.get("total_tokens", 0))))
            if resp.status_code == 429:   # as a polite client would, but short: keep the limiter busy
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=30) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return out


def redis_now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return float(seconds) + micros / 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    r = redis.Redis.from_url(args.redis_url)
    prefix = f"bench-limits-{int(time.time())}:"
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "demo-upstream", "--port", str(port),
                                 "--token-delay-ms", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        stack.callback(proc.kill)
        env = {"BENCH_ADMIN_KEYS": ADMIN, "BENCH_TEAM_KEYS": KEY, "HETEROGATE_CLUSTER_TOKEN": "bench-cluster-token"}
        gateways: list[Gateway] = []
        for i in range(args.replicas):
            where = Path(tmp) / f"replica-{i}"
            where.mkdir()
            config = write_config(where, cluster(upstream, args.limit, prefix))
            gateways.append(stack.enter_context(run_gateway(config, "--redis-url", args.redis_url, healthy=1,
                                                            timeout=90, admin_key=ADMIN, env=env)))
        offset = redis_now(r) - time.monotonic()
        first = (int(redis_now(r)) // 60 + 1) * 60          # the next whole minute starts the first window
        until = first + 60 * args.windows
        print(f"{args.replicas} replicas ready; load until the end of {args.windows} window(s) "
              f"(~{until - redis_now(r):.0f} s)", flush=True)
        counts: dict[int, int] = {}   # window -> the limiter's count as last read
        key = f"{prefix}tenant:{{team}}:tokens_per_minute"
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                w, n = r.hmget(key, "w", "n")
                if w is not None and n is not None:
                    counts[int(w)] = int(n)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        sent = asyncio.run(load([g.url for g in gateways], args.concurrency, until, offset))
        stop.set()
        watcher.join()
        windows = []
        for w in range(args.windows):
            start = first + 60 * w
            inside = [s for s in sent if start <= s.at < start + 60]
            served = sum(s.tokens for s in inside if s.status == 200)
            windows.append({
                "window_start": start, "served_tokens": served, "limit": args.limit,
                "admitted_share": served / args.limit, "served_requests": sum(s.status == 200 for s in inside),
                "refused_429": sum(s.status == 429 for s in inside),
                "other_status": sorted({s.status for s in inside} - {200, 429}),
                "limiter_count": counts.get(start // 60), "limiter_share": counts.get(start // 60, 0) / args.limit,
            })
    for key in r.scan_iter(f"{prefix}*"):
        r.delete(key)
    return {"replicas": args.replicas, "limit_tokens_per_minute": args.limit, "concurrency": args.concurrency,
            "windows": windows}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['replicas']} replicas, one tenant, tokens_per_minute {result['limit_tokens_per_minute']}")
    print("| window | served tokens | of the limit | limiter's count | of the limit | served requests | 429s | other |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, w in enumerate(result["windows"]):
        print(f"| {i + 1} | {w['served_tokens']} | {100 * w['admitted_share']:.1f}% | {w['limiter_count']} | "
              f"{100 * w['limiter_share']:.1f}% | {w['served_requests']} | {w['refused_429']} | "
              f"{w['other_status'] or '-'} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=20000, help="the tenant's tokens per minute")
    p.add_argument("--windows", type=int, default=2, help="whole minutes measured")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tenant_limit_replicas.json")
    args = p.parse_args()
    result = run(args)
    print_table(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
