"""The leader replica killed under load: what the surviving replica answers meanwhile.

    python benchmarks/leader_failover.py [--rounds 3] [--rate 100] [--before-s 2] [--after-s 8]
                                         [--lease-ms 3000] [--checkout DIR] [--out FILE]

Each round starts two gateway replicas on the Redis at 127.0.0.1:6379 under a fresh key prefix,
with two managed simulated engines (H100, L40S): the first replica takes the leader lease and
launches them. A client sends `--rate` completions a second, open loop, to the second replica; after
`--before-s` the leader is killed with SIGKILL and the client goes on for `--after-s`. Counted: the
requests that did not get a 200, when the first and the last of them were sent (from the kill),
whether the engines serving afterwards are the same processes (adopted) or new ones (relaunched),
and for how long after the kill the survivor's /admin/backends (read every 50 ms) did not show
every backend healthy. `--checkout DIR` runs another
checkout's gateway (`git archive <commit> | tar -x -C DIR`), for a before/after. Prints the table;
`--out FILE` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "llava-1.5-7b"
BACKENDS = ("h100-0", "l40s-0")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Round:
    requests: int
    failed: int
    statuses: dict[str, int]
    first_failure_s: float | None   # from the kill, when the request was sent
    last_failure_s: float | None
    engines: str                    # adopted (same processes) or relaunched
    degraded_s: float               # after the kill, time the survivor did not see every backend healthy


@contextmanager
def replica(checkout: Path, work: Path, name: str, prefix: str, lease_ms: int) -> Any:
    d = work / name
    d.mkdir()
    config = d / "backends.yaml"
    config.write_text(yaml.safe_dump({
        "model": MODEL,
        "gateway": {"redis": {"key_prefix": prefix, "leader_lease_ms": lease_ms}},
        "backends": [{"id": b, "gpu": b.split("-")[0].upper(), "launch": {"time_scale": 0.2}} for b in BACKENDS],
    }))
    port, grpc_port = free_port(), free_port()
    with open(d / "gateway.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--port", str(port), "--grpc-port",
             str(grpc_port), "--redis-url", REDIS_URL, "--log-level", "warning"],
            cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: all_healthy(url), 120, f"{name} never saw every backend healthy")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def backends(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/admin/backends", timeout=5).json()["data"])


def all_healthy(url: str) -> bool:
    try:
        bs = backends(url)
    except httpx.HTTPError:
        return False
    return len(bs) == len(BACKENDS) and all(b["healthy"] for b in bs)


def wait(predicate: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.05)
    return time.monotonic() - t0


def one_round(checkout: Path, rate: float, before_s: float, after_s: float, lease_ms: int) -> Round:
    prefix = f"hgbench:failover:{uuid.uuid4().hex[:8]}:"
    try:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            leader, _ = stack.enter_context(replica(checkout, Path(tmp), "a", prefix, lease_ms))
            _, survivor = stack.enter_context(replica(checkout, Path(tmp), "b", prefix, lease_ms))
            pids_before = {b["id"]: b["pid"] for b in backends(survivor)}
            outcomes: list[tuple[float, str]] = []   # (sent, from the start; status or error)
            lock = threading.Lock()
            client = stack.enter_context(httpx.Client(base_url=survivor, timeout=10,
                                                      limits=httpx.Limits(max_connections=64)))

            def send(sent: float) -> None:
                try:
                    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
                    outcome = str(r.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                with lock:
                    outcomes.append((sent, outcome))

            pool = stack.enter_context(ThreadPoolExecutor(64))
            start = time.monotonic()
            killed_at: float | None = None
            views: list[tuple[float, bool]] = []   # (read at, from the start; every backend healthy)
            watching = threading.Event()

            def watch() -> None:
                while not watching.is_set():
                    views.append((time.monotonic() - start, all_healthy(survivor)))
                    time.sleep(0.05)

            watcher = threading.Thread(target=watch)
            watcher.start()
            n = 0
            while (now := time.monotonic() - start) < before_s + after_s:
                if killed_at is None and now >= before_s:
                    leader.send_signal(signal.SIGKILL)
                    killed_at = now
                pool.submit(send, now)
                n += 1
                time.sleep(max(0.0, start + n / rate - time.monotonic()))
            pool.shutdown(wait=True)
            wait(lambda: all_healthy(survivor), 60, "the survivor never had every backend back")
            watching.set()
            watcher.join()
            assert killed_at is not None
            degraded_s = sum(b[0] - a[0] for a, b in itertools.pairwise(views) if a[0] >= killed_at and not a[1])
            pids_after = {b["id"]: b["pid"] for b in backends(survivor)}
            failures = sorted(t - killed_at for t, o in outcomes if o != "200")
            statuses: dict[str, int] = {}
            for _, o in outcomes:
                statuses[o] = statuses.get(o, 0) + 1
            return Round(len(outcomes), len(failures), statuses, failures[0] if failures else None,
                         failures[-1] if failures else None,
                         "adopted" if pids_after == pids_before else "relaunched", degraded_s)
    finally:
        with redis.Redis.from_url(REDIS_URL, socket_timeout=2) as r:
            keys = list(r.scan_iter(match=prefix + "*", count=1000))
            if keys:
                r.delete(*keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=100.0, help="requests a second to the surviving replica")
    p.add_argument("--before-s", type=float, default=2.0)
    p.add_argument("--after-s", type=float, default=8.0)
    p.add_argument("--lease-ms", type=int, default=3000, help="gateway.redis.leader_lease_ms")
    p.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose gateway runs")
    p.add_argument("--out", type=Path, help="also write the rounds here as JSON")
    a = p.parse_args()
    rounds = [one_round(a.checkout.resolve(), a.rate, a.before_s, a.after_s, a.lease_ms) for _ in range(a.rounds)]
    print(f"checkout {a.checkout}, {a.rate:g} req/s to the survivor, leader SIGKILLed after {a.before_s:g} s, "
          f"lease {a.lease_ms} ms")
    print("| round | requests | failed | first / last failure after the kill, s | engines "
          "| backends not all healthy, s |")
    print("|---:|---:|---:|---|---|---:|")
    for i, r in enumerate(rounds, 1):
        span = "—" if r.first_failure_s is None else f"{r.first_failure_s:.2f} / {r.last_failure_s:.2f}"
        print(f"| {i} | {r.requests} | {r.failed} | {span} | {r.engines} | {r.degraded_s:.2f} |")
    if a.out:
        a.out.write_text(json.dumps({"checkout": str(a.checkout), "rate": a.rate, "lease_ms": a.lease_ms,
                                     "pid": os.getpid(), "rounds": [asdict(r) for r in rounds]}, indent=1))


if __name__ == "__main__":
    main()
