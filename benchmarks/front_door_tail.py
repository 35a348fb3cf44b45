"""Where the front door's tail at c=64 comes from: wrk's p50 and p99 beside the gateway's own view of each
request, in wall time and in the CPU time of its process.

    python benchmarks/front_door_tail.py [--rounds 3] [--duration 5] [--workers-redis-url URL] [--out FILE]

Targets in front of two benchmarks/mock_openai_engine.py on loopback (as benchmarks/front_door.py):
`direct` (one mock), `io-floor` (benchmarks/io_floor_proxy.py: the gateway's HTTP server and upstream
client, no gateway logic), `gateway` (one process, the mocks as `kind: openai` backends) and, with a
Redis, `gateway-2w` (`--workers 2`). The io-floor and the one-process gateway run traced (this script
with `--traced`, which wraps their HTTP server before starting them): for every request, the loop time
and the process's CPU time (`time.thread_time`: the loop's thread) when its message was complete and
when its response was written; every garbage collection with its generation and length; and how late
a 1 ms sleep wakes, with the CPU the loop spent meanwhile. A request whose wall time is far above its
CPU time waited while the process was not running (the machine had other work); its CPU time is
the queue of other requests' work ahead of it, which is what the front door itself adds.

Non-streamed, `max_tokens` 4, c=64, each round the targets in turn. Writes
benchmarks/results/front_door_tail.json and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from benchmarks.bench_cluster import launch  # noqa: E402
from benchmarks.front_door import body, mock_engines, openai_config, process, wait_http  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from testkit.harness import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "front_door_tail.json"
TRACE_ENV = "FRONT_DOOR_TAIL_TRACE"   # where a traced process writes its trace when it stops
LATE_S = 0.002                        # a 1 ms sleep that wakes later than this is recorded


def traced(run: Callable[[], object]) -> None:
    """Runs `run` (a server's main) with its HTTP server, collector and loop traced; writes the trace
    to $FRONT_DOOR_TAIL_TRACE when it returns or is interrupted."""
    import asyncio

    from gateway.doors import http_server as hs

    requests: list[tuple[float, float, float, float]] = []   # complete (wall, cpu), responded (wall, cpu)
    collections: list[tuple[int, float, float]] = []          # generation, start, end
    late: list[tuple[float, float, float]] = []               # when, how late, CPU meanwhile
    arrived: dict[int, tuple[float, float]] = {}
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            collections.append((info["generation"], gc_start[0], time.perf_counter()))

    gc.callbacks.append(on_gc)
    complete, next_request, respond, start = (hs._Connection.on_message_complete, hs._Connection._next,
                                              hs.Exchange.respond, hs.HttpServer.start)

    def on_message_complete(self: Any) -> None:
        self.arrived = (time.perf_counter(), time.thread_time())
        complete(self)

    def _next(self: Any) -> None:
        stamp = getattr(self, "arrived", None)
        next_request(self)
        if self._exchange is not None and stamp is not None:
            arrived[id(self._exchange)] = stamp

    def responded(self: Any, *args: Any, **kwargs: Any) -> None:
        respond(self, *args, **kwargs)
        stamp = arrived.pop(id(self), None)
        if stamp is not None:
            requests.append((*stamp, time.perf_counter(), time.thread_time()))

    async def watch_loop() -> None:
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            lag = time.perf_counter() - wall - 0.001
            if lag > LATE_S:
                late.append((wall, lag, time.thread_time() - cpu))

    async def started(self: Any, sock: Any) -> None:
        self.watcher = asyncio.get_running_loop().create_task(watch_loop())
        await start(self, sock)

    hs._Connection.on_message_complete = on_message_complete   # type: ignore[method-assign]
    hs._Connection._next = _next   # type: ignore[method-assign]
    hs.Exchange.respond = responded   # type: ignore[method-assign]
    hs.HttpServer.start = started   # type: ignore[method-assign]
    try:
        run()
    except KeyboardInterrupt:
        pass
    finally:
        Path(os.environ[TRACE_ENV]).write_text(json.dumps(
            {"requests": requests, "collections": collections, "late": late}))


def pct(values: list[float], q: float) -> float:
    return loadgen.percentile(sorted(values), q)


def trace_summary(trace: dict[str, Any], since: float, until: float) -> dict[str, float]:
    """A trace's requests, collections and late wake-ups between `since` and `until` (one measured run;
    the traced processes' clock is this one's, CLOCK_MONOTONIC)."""
    def within(t: float) -> bool:
        return since <= t < until

    reqs = [r for r in trace["requests"] if within(r[0])]
    wall = [(r[2] - r[0]) * 1000 for r in reqs]
    cpu = [(r[3] - r[1]) * 1000 for r in reqs]
    out = {"requests": len(reqs), "wall_p50_ms": pct(wall, 50), "wall_p99_ms": pct(wall, 99),
           "cpu_p50_ms": pct(cpu, 50), "cpu_p99_ms": pct(cpu, 99)}
    for gen in (0, 1, 2):
        lengths = [(e - s) * 1000 for g, s, e in trace["collections"] if g == gen and within(s)]
        out[f"gc{gen}_count"] = len(lengths)
        out[f"gc{gen}_max_ms"] = max(lengths, default=0.0)
    late = [(lag, cpu) for t, lag, cpu in trace["late"] if within(t) and lag > 0.010]
    out["stalls_over_10ms"] = len(late)
    out["stall_wall_ms"] = sum(lag for lag, _ in late) * 1000
    out["stall_cpu_ms"] = sum(cpu for _, cpu in late) * 1000
    return out


def measure(url: str, duration_s: float) -> dict[str, float]:
    r = loadgen.wrk(url + "/v1/chat/completions", 64, duration_s, body(4, False))
    return {"rps": r.rps, "p50_ms": r.p50_us / 1000, "p99_ms": r.p99_us / 1000, "mean_ms": r.mean_us / 1000,
            "errors": r.errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    p.add_argument("--workers-redis-url", default="redis://127.0.0.1:6379/0",
                   help="Redis for the `--workers 2` target (empty: leave it out)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--traced", choices=("gateway", "io-floor"), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.traced == "gateway":
        from gateway.cli import main as gateway_main
        sys.argv = ["gateway", *rest]
        traced(gateway_main)
        return 0
    if args.traced == "io-floor":
        from benchmarks.io_floor_proxy import main as io_floor_main
        traced(lambda: io_floor_main(rest))
        return 0
    started = time.monotonic()
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        urls = mock_engines(stack, tmp)
        targets: dict[str, tuple[str, Path | None]] = {"direct": (urls[0], None)}
        traces = {name: tmp / f"{name}.trace.json" for name in ("io-floor", "gateway")}
        port = free_port()
        os.environ[TRACE_ENV] = str(traces["io-floor"])
        io_floor = stack.enter_context(process(
            [sys.executable, __file__, "--traced", "io-floor", "--port", str(port), *urls], tmp / "io-floor.log"))
        wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", io_floor)
        targets["io-floor"] = (f"http://127.0.0.1:{port}", traces["io-floor"])
        os.environ[TRACE_ENV] = str(traces["gateway"])
        (tmp / "gateway").mkdir()
        gw = stack.enter_context(launch(openai_config(tmp / "gateway", urls),
                                        [sys.executable, __file__, "--traced", "gateway"]))
        targets["gateway"] = (gw.url, traces["gateway"])
        if args.workers_redis_url:
            (tmp / "gateway-2w").mkdir()
            config = openai_config(tmp / "gateway-2w", urls, redis={"key_prefix": f"front-door-tail-{os.getpid()}:"})
            two = stack.enter_context(launch(config, [sys.executable, "-m", "gateway.cli", "--workers", "2",
                                                      "--redis-url", args.workers_redis_url]))
            wait_http(f"{two.url}/v1/chat/completions", two.process)
            targets["gateway-2w"] = (two.url, None)
        for url, _ in targets.values():
            measure(url, 2.0)   # warm-up
        windows: dict[str, list[tuple[float, float]]] = {name: [] for name in traces}
        for i in range(args.rounds):
            row = {}
            for name, (url, _) in targets.items():
                print(f"round {i + 1}/{args.rounds}: {name}", flush=True)
                since = time.perf_counter()
                row[name] = measure(url, args.duration)
                if name in windows:
                    windows[name].append((since, time.perf_counter()))
            rounds.append(row)
        for name, proc in (("io-floor", io_floor), ("gateway", gw.process)):
            proc.send_signal(signal.SIGINT if name == "io-floor" else signal.SIGTERM)
            proc.wait(30)
        summaries = {name: [trace_summary(json.loads(traces[name].read_text()), *window) for window in windows[name]]
                     for name in traces}
    summary = {name: _medians([r[name] for r in rounds]) for name in rounds[0]}
    traced_summary = {name: _medians(rows) for name, rows in summaries.items()}
    print_tables(summary, traced_summary)
    save_report(args.out, {"wall_s": time.monotonic() - started, "git": git_state(), "cpus": os.cpu_count(),
                           "duration_s": args.duration, "summary": summary, "traced": traced_summary,
                           "rounds": rounds, "traced_rounds": summaries})
    return 0


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def print_tables(summary: dict[str, dict[str, float]], traced_summary: dict[str, dict[str, float]]) -> None:
    print("| target | req/s c=64 | p50 ms | p99 ms | p99 / p50 |")
    print("|---|---:|---:|---:|---:|")
    for name, r in summary.items():
        print(f"| {name} | {r['rps']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['p99_ms'] / r['p50_ms']:.1f} |")
    print("\nInside the process, from the request's last byte read to its response written:")
    print("| target | wall p50 ms | wall p99 ms | CPU p50 ms | CPU p99 ms | loop stalls > 10 ms | their wall ms | "
          "their CPU ms | gen 1 / gen 2 collections |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, t in traced_summary.items():
        print(f"| {name} | {t['wall_p50_ms']:.1f} | {t['wall_p99_ms']:.1f} | {t['cpu_p50_ms']:.1f} | "
              f"{t['cpu_p99_ms']:.1f} | {t['stalls_over_10ms']:.0f} | {t['stall_wall_ms']:,.0f} | "
              f"{t['stall_cpu_ms']:,.0f} | {t['gc1_count']:.0f} / {t['gc2_count']:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
