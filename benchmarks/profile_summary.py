"""Where profiles of the gateway spend their samples: py-spy categories and hotspots, perf layers.

py-spy: `--format raw --threads` output (collapsed stacks, one `frame;frame;... count` line per
distinct stack, the first frame naming the thread). Each main-thread sample goes to one category,
decided from the leaf up: native frames that are costs of their own (the garbage collector,
getpid, orjson, protobuf; present only with --native) first, then the innermost Python frame's
library (which then includes the C and kernel time of what it called); a sample whose innermost
Python frame is the event loop itself (Runner.run) goes to the native code under it, else to the
event loop. Hotspots are inclusive (a sample counts for every hotspot on its stack), so they overlap.

perf: `perf report --sort dso,sym -g none` text of a `perf record -e cpu-clock` of the whole
process (all threads, user and kernel): every sample is CPU time, so layers are unbiased shares of
the gateway's CPU, grouped by shared object and, for the kernel and libpython, by symbol.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_THREAD = re.compile(r"^thread \((?P<tid>\d+)\): (?P<name>.*)$")

# (category, substrings of a native frame) — checked on the native frames under the innermost Python frame.
NATIVE_COSTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("garbage collector (gc_collect)", ("gc_collect",)),
    ("getpid() in asyncio.get_running_loop (CPython 3.11)", ("getpid",)),
    ("orjson (loads/dumps)", ("orjson",)),
    ("protobuf (upb: build/serialize/parse)", ("_message.abi3", "upb_", "PyUpb")),
)
# (category, substrings of the innermost Python frame's location), first match wins.
PYTHON_LIBS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpc.aio client (call set-up, reads, cancel; incl. C-core)", ("grpc/",)),
    ("FastAPI native telemetry check (OpenTelemetry)", ("fastapi/telemetry", "opentelemetry/", "trace/__init__")),
    ("FastAPI/Starlette (middleware, routing, Request/Response)", ("fastapi/", "starlette/")),
    ("pydantic (request validation)", ("pydantic/",)),
    ("prometheus_client (counters, histograms)", ("prometheus_client/",)),
    ("structlog", ("structlog/",)),
    ("gateway: control stream (heartbeats)", ("gateway/control/heartbeat_service.py",)),
    ("gateway: HTTP server (parse, handler task, response writes)", ("gateway/doors/http_server.py",)),
    ("gateway: HTTP door (completions door, openai_*)", ("gateway/doors/completions.py", "gateway/doors/routes.py",
                                                         "gateway/requests/", "gateway/clients/openai_upstream.py")),
    ("gateway: pipeline, routing, state table, engine client", ("gateway/",)),
    ("asyncio (tasks, wait, timeout, events)", ("asyncio/", "contextlib.py", "_weakrefset.py")),
)
# Under the event loop with no other Python frame: whose native code runs.
LOOP_NATIVE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpc.aio client (call set-up, reads, cancel; incl. C-core)", ("cygrpc",)),
    ("gateway: HTTP server (parse, handler task, response writes)", ("httptools", "parser.c")),
)
EVENT_LOOP = "event loop (uvloop/libuv: polling, callbacks, task steps)"
OTHER = "other Python"
HOTSPOTS: dict[str, tuple[str, ...]] = {
    "parse(): orjson.loads + pydantic validation": ("parse (gateway/doors/completions.py",),
    "completion_body (orjson.dumps)": ("completion_body",),
    "Pipeline.start (route + dispatch + first token)": ("Pipeline.start",),
    "Pipeline._decide (policy.choose + decision metrics)": ("Pipeline._decide",),
    "EngineClient.generate (grpc stream reads)": ("EngineClient.generate",),
    "Dispatch.rest (remaining chunks)": ("Dispatch.rest",),
    "RequestLog.finish: request counter + log line": ("RequestLog.finish",),
    "prometheus_client (any)": ("prometheus_client/",),
    "structlog (any)": ("structlog/",),
    "FastAPI NativeTelemetry.enabled": ("NativeTelemetry.enabled",),
    "asyncio.timeout (first-token timeout)": ("asyncio/timeouts.py",),
    "ControlService.Connect (heartbeats)": ("ControlService.Connect",),
    "garbage collector": ("gc_collect",),
    "getpid syscall": ("getpid (libc",),
}


@dataclass
class ThreadProfile:
    tid: int
    name: str
    samples: int = 0
    stacks: Counter[tuple[str, ...]] = field(default_factory=Counter)


def read_raw(path: Path) -> dict[int, ThreadProfile]:
    threads: dict[int, ThreadProfile] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = tuple(stack.split(";"))
        m = _THREAD.match(frames[0])
        tid, name = (int(m["tid"]), m["name"]) if m else (0, frames[0])
        t = threads.setdefault(tid, ThreadProfile(tid, name))
        t.samples += int(count)
        t.stacks[frames[1:]] += int(count)
    return threads


def _match(frame: str, needles: tuple[str, ...]) -> bool:
    return any(n in frame for n in needles)


def category(frames: tuple[str, ...]) -> str:
    py = max((i for i, f in enumerate(frames) if ".py:" in f or "<frozen" in f), default=-1)
    native = frames[py + 1:]
    for name, needles in NATIVE_COSTS:
        if any(_match(f, needles) for f in native):
            return name
    if py < 0:
        return EVENT_LOOP
    if "asyncio/runners.py" in frames[py]:
        for name, needles in LOOP_NATIVE:
            if any(_match(f, needles) for f in native):
                return name
        return EVENT_LOOP
    for name, needles in PYTHON_LIBS:
        if _match(frames[py], needles):
            return name
    return OTHER


def summarise(
    threads: dict[int, ThreadProfile], main_tid: int, thread_cpu: dict[int, tuple[str, float]]
) -> dict[str, Any]:
    """Categories as % of the whole gateway's CPU (main-thread share × category share of its samples).

    `thread_cpu`: tid -> (name from /proc, CPU seconds over the profiled window).
    """
    thread_cpu_s = {tid: cpu for tid, (_, cpu) in thread_cpu.items()}
    total_cpu = sum(thread_cpu_s.values()) or 1.0
    main = threads.get(main_tid)
    main_cpu = thread_cpu_s.get(main_tid, 0.0)
    cats: Counter[str] = Counter()
    hot: Counter[str] = Counter()
    if main is not None:
        for frames, n in main.stacks.items():
            cats[category(frames)] += n
            for name, needles in HOTSPOTS.items():
                if any(_match(f, needles) for f in frames):
                    hot[name] += n
    main_samples = max(1, main.samples if main else 0)
    main_share = main_cpu / total_cpu
    rows = [{"category": c, "main_thread_samples": n, "pct_of_main_thread": 100 * n / main_samples,
             "pct_of_gateway_cpu": 100 * main_share * n / main_samples} for c, n in cats.most_common()]
    names = {t.tid: t.name for t in threads.values()}
    other_threads: dict[str, float] = defaultdict(float)
    for tid, (proc_name, cpu) in thread_cpu.items():
        if tid != main_tid:
            other_threads[names.get(tid, f"{proc_name} (native)")] += cpu
    for name, cpu in sorted(other_threads.items(), key=lambda kv: -kv[1]):
        rows.append({"category": f"thread: {name}", "main_thread_samples": 0, "pct_of_main_thread": 0.0,
                     "pct_of_gateway_cpu": 100 * cpu / total_cpu})
    hotspots = [{"hotspot": h, "pct_of_main_thread": 100 * n / main_samples,
                 "pct_of_gateway_cpu": 100 * main_share * n / main_samples} for h, n in hot.most_common()]
    return {"main_thread_share_of_cpu": main_share, "main_thread_samples": main_samples,
            "categories": rows, "hotspots": hotspots}


def to_speedscope(threads: dict[int, ThreadProfile], name: str) -> dict[str, Any]:
    """The collapsed stacks as a speedscope "sampled" profile per thread (open at speedscope.app)."""
    frames: list[dict[str, str]] = []
    index: dict[str, int] = {}
    profiles = []
    for t in sorted(threads.values(), key=lambda t: -t.samples):
        samples, weights = [], []
        for stack, n in t.stacks.items():
            samples.append([index.setdefault(f, len(index)) for f in stack])
            weights.append(n)
        profiles.append({"type": "sampled", "name": f"{t.name} ({t.tid})", "unit": "none", "startValue": 0,
                         "endValue": sum(weights), "samples": samples, "weights": weights})
    frames = [{"name": f} for f in sorted(index, key=index.__getitem__)]
    return {"$schema": "https://www.speedscope.app/file-format-schema.json", "name": name,
            "shared": {"frames": frames}, "profiles": profiles}


def write_speedscope(threads: dict[int, ThreadProfile], path: Path, name: str) -> None:
    path.write_text(json.dumps(to_speedscope(threads, name)))


_PERF_LINE = re.compile(r"^\s+(?P<pct>[\d.]+)%\s+(?P<dso>\S+)\s+\[(?P<kind>.)\]\s+(?P<sym>.+?)\s*$")
_GC_SYMBOLS = ("gc_collect", "visit_reachable", "visit_decref", "move_unreachable", "update_refs", "subtract_refs",
               "deduce_unreachable", "move_legacy_finalizers", "gc_collect_main", "_PyGC_")
_SWITCH_SYMBOLS = ("finish_task_switch", "__schedule", "schedule", "__switch_to", "pick_next_task", "psi_")
PERF_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpc (cygrpc: C-core + Cython glue)", ("cygrpc",)),
    ("uvloop/libuv", ("uvloop", "loop.cpython")),
    ("protobuf (upb)", ("_message.abi3",)),
    ("pydantic-core", ("_pydantic_core",)),
    ("httptools (HTTP parser)", ("parser.cpython", "url_parser")),
    ("orjson", ("orjson",)),
    ("_asyncio (C tasks/futures)", ("_asyncio",)),
    ("libc (malloc, memcpy, syscall stubs)", ("libc.so",)),
)


def perf_layers(report: str) -> list[dict[str, Any]]:
    """Shares of CPU by layer from `perf report --stdio --no-children --sort dso,sym -g none` text."""
    layers: defaultdict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = _PERF_LINE.match(line)
        if m is None:
            continue
        pct, dso, sym = float(m["pct"]), m["dso"], m["sym"]
        if dso.startswith("[kernel"):
            name = ("kernel: context switches (sleep/wake: futex, epoll, preemption)"
                    if sym.startswith(_SWITCH_SYMBOLS) else "kernel: syscalls, TCP loopback, interrupts")
        elif "libpython" in dso:
            name = ("CPython garbage collector" if sym.startswith(_GC_SYMBOLS)
                    else "CPython interpreter (eval loop, objects, allocator)")
        else:
            name = next((layer for layer, needles in PERF_LAYERS if _match(dso, needles)), f"other: {dso}")
        layers[name] += pct
    return [{"layer": k, "pct_of_gateway_cpu": v} for k, v in sorted(layers.items(), key=lambda kv: -kv[1])]
