"""What the gateway adds on top of the engine it routes to: throughput and latency, side by side.

    python benchmarks/gateway_overhead.py [--quick] [--rounds 3] [--duration 2]

One run starts a gateway (`--log-level warning`) in front of fast engines on loopback and drives
the same request two ways, alternating them round by round so that a change in background load
hits both:

    direct          GenerateRequest straight to the engine's gRPC Generate, Python grpc.aio client
                    (benchmarks/grpc_load.py; one channel, N concurrent streams, as the gateway does);
    direct h2load   the same call from h2load (C), the floor of what an engine answers in;
    gateway         POST /v1/chat/completions, non-streaming, from wrk (C, keep-alive connections);
    gateway stream  the same with "stream": true (server-sent events).

The request: one user message (11 prompt tokens), max_tokens 4, so the run is dominated by the
request path. The engine: `stub` (benchmarks/stub_engine.py: answers at once, no batcher; the
default, as it costs the least CPU of a 2-core machine that also runs the gateway and the load
generator, and gives the cleanest "direct"), and in the full run also `sim` (the real engine with
--time-scale 0: continuous batcher running, tokens immediately). Scenarios: stub x1 (c = 1, 16,
64; every path), stub x4 (c = 64; direct spreads over the four engines), sim x1 (c = 1, 64).
Closed loop: N requests always in flight; each cell is the median over rounds. "Added" = gateway −
direct at the same concurrency.

CPU: utime + stime of the gateway and engine processes (/proc) over each run, and of the generator
(RUSAGE_CHILDREN for wrk and h2load; the Python client's own process_time over its load loop),
divided by the requests served: CPU µs per request, which moves far less with background load than
req/s does. 1e6 / (gateway CPU µs per request) is the gateway's single-core ceiling. The
generators' own ceilings: wrk against GET /health, and each generator's CPU per request.
Background CPU (other processes on the machine: busy CPU from /proc/stat minus ours) is recorded
per run. Writes benchmarks/results/gateway_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from benchmarks.bench_cluster import MODEL, Cluster, EngineKind, running_cluster  # noqa: E402
from benchmarks.grpc_load import generate_request  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gateway_overhead.json"
MAX_TOKENS = 4
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
TARGET_RPS, TARGET_ADDED_P50_MS = 5000.0, 0.5
PATHS = ("direct", "direct_h2load", "gateway", "gateway_stream")
GENERATE_PATH = "/heterogate.engine.v1.Engine/Generate"


@dataclass(frozen=True)
class Scenario:
    engine: EngineKind
    backends: int
    concurrencies: tuple[int, ...]
    paths: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.engine}x{self.backends}"


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of all cores since boot (/proc/stat; busy = user+nice+system+irq+softirq)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / loadgen.CLK_TCK, f[7] / loadgen.CLK_TCK


def run_path(cluster: Cluster, path: str, concurrency: int, duration_s: float) -> loadgen.LoadResult:
    body = json.dumps(CHAT).encode()
    if path == "direct":
        return loadgen.grpc_py(cluster.addresses, concurrency, duration_s, MAX_TOKENS)
    if path == "direct_h2load":
        frame = loadgen.grpc_frame(generate_request("h2load", MAX_TOKENS).SerializeToString())
        return loadgen.h2load_grpc(cluster.addresses[0], GENERATE_PATH, frame, concurrency, duration_s)
    if path == "gateway_stream":
        body = json.dumps({**CHAT, "stream": True}).encode()
    return loadgen.wrk(f"{cluster.url}/v1/chat/completions", concurrency, duration_s, body)


def measure(cluster: Cluster, path: str, concurrency: int, duration_s: float) -> dict[str, Any]:
    meter = loadgen.CpuMeter({"gateway": [cluster.gateway_pid], "engines": cluster.engine_pids})
    (busy0, steal0), t0 = machine_cpu_s(), time.monotonic()
    meter.start()
    result = run_path(cluster, path, concurrency, duration_s)
    cpu = meter.stop()
    (busy1, steal1), wall = machine_cpu_s(), time.monotonic() - t0
    ours = cpu["gateway"] + cpu["engines"] + result.client_cpu_s
    return {**result.as_dict(), "path": path, "gateway_cpu_s": cpu["gateway"], "engines_cpu_s": cpu["engines"],
            "wall_s": wall, "background_cpu_s": max(0.0, busy1 - busy0 - ours), "steal_cpu_s": steal1 - steal0}


def check_paths(cluster: Cluster) -> None:
    """One request of each kind, checked, before anything is timed."""
    with httpx.Client(base_url=cluster.url, timeout=10) as client:
        r = client.post("/v1/chat/completions", json=CHAT)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS, r.text
        r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    probe = loadgen.grpc_py(cluster.addresses, 1, 0.2, MAX_TOKENS)
    assert probe.requests > 0 and probe.errors == 0, probe


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of the rates and percentiles; CPU per request over all rounds."""
    requests = int(sum(r["requests"] for r in runs))

    def per_req_us(key: str) -> float:
        return float(sum(r[key] for r in runs)) / max(1, requests) * 1e6

    return {
        "rounds": len(runs), "requests": requests, "errors": sum(r["errors"] for r in runs),
        "rps": statistics.median(r["rps"] for r in runs),
        "p50_ms": statistics.median(r["p50_us"] for r in runs) / 1000,
        "p99_ms": statistics.median(r["p99_us"] for r in runs) / 1000,
        "gateway_cpu_us_per_req": per_req_us("gateway_cpu_s"),
        "engine_cpu_us_per_req": per_req_us("engines_cpu_s"),
        "client_cpu_us_per_req": per_req_us("client_cpu_s"),
        "background_cpu_share": sum(r["background_cpu_s"] for r in runs) / max(1e-9, sum(r["wall_s"] for r in runs))
        / (os.cpu_count() or 1),
    }


def run_scenario(sc: Scenario, rounds: int, duration_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"overhead-{sc.name}-") as tmp, \
            running_cluster(sc.engine, sc.backends, Path(tmp)) as cluster:
        check_paths(cluster)
        loadgen.wrk(f"{cluster.url}/v1/chat/completions", 16, 1, json.dumps(CHAT).encode())   # warm-up
        ceiling = {
            "wrk_health": measure_health(cluster, 64, duration_s) if sc.backends == 1 else None,
        }
        runs: dict[str, list[dict[str, Any]]] = {}
        for c in sc.concurrencies:
            for r in range(rounds):
                for path in sc.paths:
                    res = measure(cluster, path, c, duration_s)
                    runs.setdefault(f"{path}@{c}", []).append(res)
                    log(f"  {sc.name} round {r + 1} {path:15s} c={c:<3d} {res['rps']:8.0f} req/s  "
                        f"p50 {res['p50_us'] / 1000:7.3f} ms  p99 {res['p99_us'] / 1000:7.3f} ms  "
                        f"gw cpu {res['gateway_cpu_s']:.2f}s  bg cpu {res['background_cpu_s']:.2f}s")
    summary = {key: summarise(v) for key, v in runs.items()}
    return {"scenario": sc.name, "engine": sc.engine, "backends": sc.backends, "ceiling": ceiling,
            "summary": summary, "added": added(summary, sc.concurrencies), "runs": runs}


def measure_health(cluster: Cluster, concurrency: int, duration_s: float) -> dict[str, Any]:
    meter = loadgen.CpuMeter({"gateway": [cluster.gateway_pid]})
    meter.start()
    res = loadgen.wrk(f"{cluster.url}/health", concurrency, duration_s)
    cpu = meter.stop()
    return {**res.as_dict(), "gateway_cpu_us_per_req": cpu["gateway"] / max(1, res.requests) * 1e6,
            "client_cpu_us_per_req": res.client_cpu_s / max(1, res.requests) * 1e6}


def added(summary: dict[str, Any], concurrencies: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in concurrencies:
        for gw in ("gateway", "gateway_stream"):
            for base in ("direct", "direct_h2load"):
                g, d = summary.get(f"{gw}@{c}"), summary.get(f"{base}@{c}")
                if g is None or d is None:
                    continue
                out[f"{gw}-{base}@{c}"] = {"p50_ms": g["p50_ms"] - d["p50_ms"], "p99_ms": g["p99_ms"] - d["p99_ms"],
                                           "rps_ratio": g["rps"] / d["rps"]}
    return out


def git_state(checkout: Path = ROOT) -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=False, timeout=30)
        return out.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(git("status", "--porcelain").splitlines())}


def save_report(path: Path, report: dict[str, Any]) -> None:
    """Every benchmark's results file: JSON beside the others, and one line saying where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} ({report['wall_s']:.0f} s)")


def print_tables(results: list[dict[str, Any]]) -> None:
    print(f"\n{'scenario':9s} {'path':15s} {'c':>3s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>8s} "
          f"{'gw µs/req':>9s} {'eng µs/req':>10s} {'client µs/req':>13s} {'bg cpu':>6s}")
    for res in results:
        for key, s in res["summary"].items():
            path, c = key.split("@")
            print(f"{res['scenario']:9s} {path:15s} {c:>3s} {s['rps']:7.0f} {s['p50_ms']:7.3f} {s['p99_ms']:8.3f} "
                  f"{s['gateway_cpu_us_per_req']:9.0f} {s['engine_cpu_us_per_req']:10.0f} "
                  f"{s['client_cpu_us_per_req']:13.0f} {s['background_cpu_share']:6.0%}")
    print(f"\n{'scenario':9s} {'added (gateway − direct)':40s} {'p50 ms':>7s} {'p99 ms':>8s} {'rps ratio':>9s}")
    for res in results:
        for key, a in res["added"].items():
            print(f"{res['scenario']:9s} {key:40s} {a['p50_ms']:7.3f} {a['p99_ms']:8.3f} {a['rps_ratio']:9.2f}")
    for res in results:
        h = res["ceiling"].get("wrk_health")
        if h:
            wrk_us = h["client_cpu_us_per_req"]
            print(f"\n{res['scenario']}: wrk GET /health c=64: {h['rps']:.0f} req/s, wrk {wrk_us:.0f} CPU µs/req "
                  f"(ceiling ≈ {1e6 / max(1e-9, wrk_us):.0f} req/s per core), "
                  f"gateway {h['gateway_cpu_us_per_req']:.0f} CPU µs/req")


def verdicts(main: dict[str, Any]) -> dict[str, Any]:
    s, a = main["summary"], main["added"]
    gw64 = s.get("gateway@64", {})
    cpu = gw64.get("gateway_cpu_us_per_req", float("nan"))
    out = {
        "gateway_rps_c64": gw64.get("rps"), "target_rps": TARGET_RPS,
        "rps_met": bool(gw64) and gw64["rps"] >= TARGET_RPS,
        "gateway_cpu_us_per_req_c64": cpu, "gateway_single_core_ceiling_rps": 1e6 / cpu if cpu else None,
        "added_p50_ms_c1_vs_grpc_aio": a.get("gateway-direct@1", {}).get("p50_ms"),
        "added_p50_ms_c1_vs_h2load": a.get("gateway-direct_h2load@1", {}).get("p50_ms"),
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
    }
    added_ms = out["added_p50_ms_c1_vs_grpc_aio"]
    out["added_met"] = added_ms is not None and added_ms <= TARGET_ADDED_P50_MS
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run (< 30 s): stub engine x1, 1 round of 1 s")
    p.add_argument("--rounds", type=int, help="rounds per cell (default 3; 1 with --quick)")
    p.add_argument("--duration", type=float, help="seconds per measurement (default 2; 1 with --quick)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    duration_s = args.duration or (1.0 if args.quick else 2.0)
    scenarios = [Scenario("stub", 1, (1, 16, 64), PATHS)]
    if not args.quick:
        scenarios += [Scenario("stub", 4, (64,), ("direct", "gateway", "gateway_stream")),
                      Scenario("sim", 1, (1, 64), ("direct", "direct_h2load", "gateway"))]
    started = time.monotonic()
    load0 = os.getloadavg()
    results = []
    for sc in scenarios:
        print(f"scenario {sc.name}: {sc.backends} {sc.engine} engine(s), c={sc.concurrencies}", flush=True)
        results.append(run_scenario(sc, rounds, duration_s, lambda line: print(line, flush=True)))
    print_tables(results)
    verdict = verdicts(results[0])
    print(f"\ntargets ({results[0]['scenario']}): gateway c=64 {verdict['gateway_rps_c64']:.0f} req/s "
          f"(target ≥ {TARGET_RPS:.0f}: {'met' if verdict['rps_met'] else 'NOT met'}; single-core ceiling from CPU "
          f"{verdict['gateway_single_core_ceiling_rps']:.0f} req/s); added p50 at c=1 "
          f"{verdict['added_p50_ms_c1_vs_grpc_aio']:.3f} ms vs grpc.aio, {verdict['added_p50_ms_c1_vs_h2load']:.3f} "
          f"ms vs h2load (target ≤ {TARGET_ADDED_P50_MS} ms: {'met' if verdict['added_met'] else 'NOT met'})")
    report = {
        "benchmark": "gateway_overhead",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg_start": load0, "loadavg_end": os.getloadavg()},
        "git": git_state(),
        "settings": {"rounds": rounds, "duration_s": duration_s, "max_tokens": MAX_TOKENS, "quick": args.quick,
                     "generators": {"http": "wrk -t1 (HTTP/1.1 keep-alive)",
                                    "grpc": "grpc.aio (uvloop) and h2load -c1"}},
        "verdict": verdict,
        "scenarios": results,
        "wall_s": time.monotonic() - started,
    }
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
