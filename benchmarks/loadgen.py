"""Closed-loop load generators for the overhead benchmarks, and CPU accounting of the processes under test.

Three generators, each a subprocess so that its own CPU is measured apart (RUSAGE_CHILDREN):

    wrk        HTTP/1.1 (C): `concurrency` keep-alive connections, one thread; a Lua script sets the
               POST body and prints the request count and latency percentiles (µs) as one JSON line.
    h2load     HTTP/2 (C, nghttp2): gRPC spoken by hand (content-type application/grpc, a
               length-prefixed GenerateRequest as the body); one connection with `concurrency`
               streams, like the gateway's one channel per engine; percentiles from its per-request log.
    grpc_load  benchmarks/grpc_load.py: a Python grpc.aio client on uvloop, one channel per address
               (its CPU is what it reports for its load loop, without interpreter start-up).

Every run is bounded by its duration; each returns a `LoadResult`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
_H2LOAD_FINISHED = re.compile(r"finished in (?P<t>[\d.]+)(?P<unit>m?s), (?P<rps>[\d.]+) req/s")

_WRK_LUA = """
wrk.method = "{method}"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "JSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"errors\\":%d,\\"non2xx\\":%d,"
    .. "\\"p50_us\\":%d,\\"p99_us\\":%d,\\"mean_us\\":%.1f}}\\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass(frozen=True)
class LoadResult:
    generator: str
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    rps: float
    p50_us: float
    p99_us: float
    mean_us: float
    client_cpu_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run(cmd: list[str], timeout_s: float) -> tuple[str, float]:
    """Run a generator to completion; returns (stdout, its CPU seconds)."""
    if shutil.which(cmd[0]) is None:
        raise SystemExit(f"{cmd[0]} is not installed (Debian/Ubuntu: apt-get install wrk nghttp2-client)")
    before = _children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    cpu = _children_cpu_s() - before
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {out.returncode}: {out.stderr.strip()[-800:]}")
    return out.stdout, cpu


def wrk(url: str, concurrency: int, duration_s: float, body: bytes | None = None) -> LoadResult:
    """GET (body None) or POST `body` as JSON, `concurrency` connections, for `duration_s`."""
    lua = _WRK_LUA.format(method="POST" if body is not None else "GET",
                          body=json.dumps(body.decode()) if body is not None else "nil")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
    try:
        cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s",
               "-s", f.name, url]
        stdout, cpu = _run(cmd, duration_s + 30)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{stdout[-800:]}")
    s = json.loads(line[5:])
    dur = s["duration_us"] / 1e6
    return LoadResult("wrk", concurrency, s["requests"], s["errors"] + s["non2xx"], dur, s["requests"] / dur,
                      float(s["p50_us"]), float(s["p99_us"]), float(s["mean_us"]), cpu)


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: flag 0 (not compressed), 4-byte big-endian length."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def h2load_grpc(address: str, method_path: str, frame: bytes, concurrency: int, duration_s: float) -> LoadResult:
    """POST `frame` to `method_path` over one h2c connection with `concurrency` streams."""
    with tempfile.TemporaryDirectory() as tmp:
        data, log = Path(tmp) / "body.bin", Path(tmp) / "requests.log"
        data.write_bytes(frame)
        cmd = ["h2load", "-c1", f"-m{concurrency}", "-t1", "-D", f"{max(1, round(duration_s))}",
               "-d", str(data), "-H", "content-type: application/grpc",
               "-H", "te: trailers", f"--log-file={log}", f"http://{address}{method_path}"]
        stdout, cpu = _run(cmd, duration_s + 30)
        rows = [ln.split("\t") for ln in log.read_text().splitlines() if ln]
    ok = sorted(float(r[2]) for r in rows if r[1] == "200")
    errors = len(rows) - len(ok)
    if not ok:
        raise RuntimeError(f"h2load: no successful request:\n{stdout[-800:]}")
    m = _H2LOAD_FINISHED.search(stdout)
    if m is None:
        raise RuntimeError(f"h2load printed no summary:\n{stdout[-800:]}")
    span_s = float(m["t"]) / (1000 if m["unit"] == "ms" else 1)
    return LoadResult("h2load", concurrency, len(ok), errors, span_s, float(m["rps"]),
                      percentile(ok, 50), percentile(ok, 99), sum(ok) / len(ok), cpu)


def grpc_py(addresses: list[str], concurrency: int, duration_s: float, max_tokens: int) -> LoadResult:
    """The Python grpc.aio client (benchmarks/grpc_load.py) in its own process."""
    cmd = [sys.executable, str(HERE / "grpc_load.py"), "--concurrency", str(concurrency),
           "--duration", str(duration_s), "--max-tokens", str(max_tokens), *addresses]
    stdout, _ = _run(cmd, duration_s + 30)
    s = json.loads(stdout.strip().splitlines()[-1])
    return LoadResult("grpc.aio", concurrency, s["requests"], s["errors"], s["duration_s"], s["rps"],
                      s["p50_us"], s["p99_us"], s["mean_us"], s["cpu_s"])


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far) for every thread of a process."""
    out: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def thread_cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[int, tuple[str, float]]:
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}


class CpuMeter:
    """CPU seconds each watched process spent between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self._start: dict[str, int] = {}

    def _ticks(self) -> dict[str, int]:
        return {role: sum(cpu_ticks(p) for p in pids) for role, pids in self.pids.items()}

    def start(self) -> None:
        self._start = self._ticks()

    def stop(self) -> dict[str, float]:
        end = self._ticks()
        return {role: (end[role] - self._start[role]) / CLK_TCK for role in end}
