"""Where the gateway's CPU goes under load: py-spy and perf on the gateway process at concurrency 64.

    python benchmarks/gateway_profile.py [--quick] [--duration 10] [--rate 200] [--engine stub]

Starts the same cluster as gateway_overhead.py (one fast engine, gateway at --log-level warning),
drives POST /v1/chat/completions (max_tokens 4, non-streaming) with wrk at concurrency 64, and
while it runs records the gateway over the same window with two profilers:

    py-spy record --nonblocking --threads --format raw   Python frames, by library (which Python
        code the CPU went to, C and kernel time included in the frame that called it); --native
        switches to native stacks, which needs blocking mode: it pauses the process per sample,
        costs it a third of its throughput and over-weights syscalls, so it is not the default;
    perf record -e cpu-clock -g (when perf is installed)  every thread, user and kernel: unbiased
        shares by layer (interpreter, garbage collector, grpc C-core, kernel context switches...).

Per-thread CPU comes from /proc over the window: the main thread's CPU is split by the py-spy
categories of profile_summary.py; the other threads (grpc.aio's completion-queue poller, grpc
C-core threads) are reported whole. Writes, under benchmarks/results/: gateway_profile.json (the
summary), gateway_profile.collapsed.txt (raw py-spy stacks; flamegraph.pl or speedscope open it),
gateway_profile.speedscope.json and gateway_profile.perf.txt (perf report by symbol).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen, profile_summary  # noqa: E402
from benchmarks.bench_cluster import EngineKind, running_cluster  # noqa: E402
from benchmarks.gateway_overhead import CHAT, git_state  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def py_spy_command(pid: int, duration_s: int, rate: int, out: Path, native: bool) -> list[str]:
    exe = Path(sys.executable).parent / "py-spy"
    mode = ["--native"] if native else ["--nonblocking"]
    return [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid), "--duration", str(duration_s),
            "--rate", str(rate), *mode, "--threads", "--format", "raw", "--output", str(out)]


def perf_start(pid: int, duration_s: int, out: Path) -> subprocess.Popen[bytes] | None:
    if shutil.which("perf") is None:
        return None
    return subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "999", "-g", "-p", str(pid), "-o", str(out),
                             "--", "sleep", str(duration_s)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_report(data: Path) -> str:
    out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym",
                          "-g", "none"], capture_output=True, text=True, timeout=120, check=False)
    return out.stdout


def profile(engine: EngineKind, concurrency: int, duration_s: int, rate: int, native: bool) -> dict[str, Any]:
    body = json.dumps(CHAT).encode()
    with tempfile.TemporaryDirectory(prefix="gateway-profile-") as tmp, \
            running_cluster(engine, 1, Path(tmp)) as cluster:
        url = f"{cluster.url}/v1/chat/completions"
        loadgen.wrk(url, 16, 1, body)   # warm-up
        unprofiled = loadgen.wrk(url, concurrency, 2, body)
        raw, perf_data = Path(tmp) / "raw.txt", Path(tmp) / "perf.data"
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
            lua.write(f"wrk.method = 'POST'\nwrk.body = {json.dumps(body.decode())}\n"
                      "wrk.headers['Content-Type'] = 'application/json'\n")
        load = subprocess.Popen(["wrk", "-t1", f"-c{concurrency}", f"-d{duration_s + 3}s", "-s", lua.name, url],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1.0)
            before, t0 = loadgen.thread_cpu(cluster.gateway_pid), time.monotonic()
            perf = perf_start(cluster.gateway_pid, duration_s, perf_data)
            spy = subprocess.run(py_spy_command(cluster.gateway_pid, duration_s, rate, raw, native),
                                 capture_output=True, text=True, timeout=duration_s + 60, check=False)
            if perf is not None:
                perf.wait(timeout=60)
            window_s = time.monotonic() - t0
            cpu = loadgen.thread_cpu_delta(before, loadgen.thread_cpu(cluster.gateway_pid))
        finally:
            wrk_out, _ = load.communicate(timeout=duration_s + 30)
            Path(lua.name).unlink()
        if spy.returncode != 0 or not raw.exists():
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {spy.stderr[-800:]}")
        threads = profile_summary.read_raw(raw)
        summary = profile_summary.summarise(threads, cluster.gateway_pid, cpu)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "gateway_profile.collapsed.txt").write_text(raw.read_text())
        profile_summary.write_speedscope(threads, RESULTS / "gateway_profile.speedscope.json",
                                         f"gateway, wrk c={concurrency}, {engine} engine")
        perf_text = perf_report(perf_data) if perf is not None and perf_data.exists() else ""
        if perf_text:
            (RESULTS / "gateway_profile.perf.txt").write_text(perf_text)
    requests_per_s = _wrk_rps(wrk_out)
    gateway_cpu_s = sum(c for _, c in cpu.values())
    return {
        "concurrency": concurrency, "duration_s": duration_s, "rate_hz": rate, "engine": engine,
        "py_spy_mode": "native, blocking" if native else "python frames, nonblocking",
        "rps_unprofiled": unprofiled.rps, "rps_while_profiled": requests_per_s,
        "gateway_cpu_cores": gateway_cpu_s / window_s,
        "gateway_cpu_us_per_req": gateway_cpu_s / window_s / requests_per_s * 1e6 if requests_per_s else None,
        "threads": {str(tid): {"name": n, "cpu_s": c} for tid, (n, c) in sorted(cpu.items()) if c > 0},
        "py_spy": spy.stderr.strip().splitlines()[-2:],
        "perf_layers": profile_summary.perf_layers(perf_text) if perf_text else None,
        **summary,
    }


def _wrk_rps(out: str) -> float:
    line = next((ln for ln in out.splitlines() if ln.startswith("Requests/sec:")), "Requests/sec: 0")
    return float(line.split()[1])


def print_summary(s: dict[str, Any]) -> None:
    print(f"\ngateway at c={s['concurrency']}: {s['rps_unprofiled']:.0f} req/s unprofiled, "
          f"{s['rps_while_profiled']:.0f} while profiled; gateway CPU {s['gateway_cpu_cores']:.2f} cores, "
          f"{s['gateway_cpu_us_per_req']:.0f} µs/request; main thread {s['main_thread_share_of_cpu']:.0%} of it")
    print(f"\n{'% gateway CPU':>13s}  category")
    for row in s["categories"]:
        print(f"{row['pct_of_gateway_cpu']:12.1f}%  {row['category']}")
    print(f"\n{'% gateway CPU':>13s}  hotspot (inclusive, overlapping)")
    for row in s["hotspots"]:
        print(f"{row['pct_of_gateway_cpu']:12.1f}%  {row['hotspot']}")
    if s["perf_layers"]:
        print(f"\n{'% gateway CPU':>13s}  layer (perf, all threads, user + kernel)")
        for row in s["perf_layers"]:
            if row["pct_of_gateway_cpu"] >= 0.1:
                print(f"{row['pct_of_gateway_cpu']:12.1f}%  {row['layer']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run (< 30 s): 4 s of profile")
    p.add_argument("--duration", type=int, help="seconds of profile (default 10; 4 with --quick)")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--engine", choices=["stub", "sim"], default="stub")
    p.add_argument("--native", action="store_true",
                   help="py-spy --native (blocking: pauses the process per sample, slows it and over-weights syscalls)")
    args = p.parse_args(argv)
    duration = args.duration or (4 if args.quick else 10)
    summary = profile(args.engine, args.concurrency, duration, args.rate, args.native)
    print_summary(summary)
    report = {"benchmark": "gateway_profile", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "git": git_state(), **summary}
    out = RESULTS / "gateway_profile.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}, gateway_profile.collapsed.txt, gateway_profile.speedscope.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
