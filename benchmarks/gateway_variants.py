"""What each proposed gateway change would buy, measured on the unchanged product code with patches.

    python benchmarks/gateway_variants.py [--quick] [--variants baseline telemetry_off ...]

Each variant is a gateway process started through this file (`--launch VARIANTS -- gateway args`),
which applies the named in-process patches and then runs `gateway.cli.main` unchanged otherwise.
The product code on disk is not modified. Patches (combine with "+"):

    telemetry_off   FastAPI(telemetry={"tracing": False, "metrics": False, "logs": False}): skips
                    the per-request OpenTelemetry provider lookups in FastAPI.__call__
    gc_freeze       gc.collect(); gc.freeze(); gc.set_threshold(50_000, 20, 100) before serving
    no_watcher      http_app.unless_disconnected awaits the work directly (no watcher task, no
                    asyncio.wait, two ensure_future fewer per await) — the saving an
                    on-disconnect callback would give
    no_metrics      prometheus_client labels() returns a no-op child (the metrics' whole cost)
    asyncio_loop    asyncio.run instead of uvloop.run
    one_write       uvicorn sends status line + headers and the body in one socket write, not two
    grpc_no_bdp     the gateway's engine channels with grpc.http2.bdp_probe 0 (no BDP PING frames)
    unix_socket     the engine listens on a Unix-domain socket (address unix:PATH in backends.yaml)
                    instead of loopback TCP
    chunk_all       engine side: the stub sends the completion in one GenerateChunk instead of one
                    per token (the gateway unchanged; what a coalescing engine/flag would give)

All variants run at once (idle ones cost nothing) and are measured in alternating rounds, so a
change of background load hits them alike: wrk POST /v1/chat/completions (max_tokens 4) at
concurrency 64 for req/s and gateway CPU µs per request, and at concurrency 1 for p50; baseline and
chunk_all also with max_tokens 64, which gives the gateway's CPU per streamed token.
Writes benchmarks/results/gateway_variants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from benchmarks.bench_cluster import Cluster, running_cluster  # noqa: E402
from benchmarks.gateway_overhead import CHAT, git_state, save_report  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gateway_variants.json"
PER_TOKEN_VARIANTS = ("baseline", "chunk_all")   # also measured with max_tokens 64: gateway CPU per token
DEFAULT_VARIANTS = ("baseline", "telemetry_off", "gc_freeze", "no_watcher", "no_metrics", "one_write",
                    "grpc_no_bdp", "unix_socket", "asyncio_loop", "chunk_all",
                    "telemetry_off+gc_freeze+no_watcher+no_metrics+one_write+grpc_no_bdp")


def _telemetry_off() -> None:
    from fastapi import FastAPI

    import gateway.http_app as http_app
    setattr(http_app, "FastAPI",  # noqa: B010 - replacing a module attribute on purpose
            functools.partial(FastAPI, telemetry={"tracing": False, "metrics": False, "logs": False}))


def _gc_freeze() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _no_watcher() -> None:
    import gateway.http_app as http_app

    async def direct(request: Any, work: Any) -> Any:
        return await work

    http_app.unless_disconnected = direct


def _no_metrics() -> None:
    from prometheus_client import metrics

    class Noop:
        def inc(self, amount: float = 1) -> None:
            pass

        def observe(self, amount: float) -> None:
            pass

    noop = Noop()
    metrics.MetricWrapperBase.labels = lambda self, *a, **k: noop  # type: ignore[method-assign, assignment]


def _one_write() -> None:
    """uvicorn writes the status line + headers at http.response.start and the body apart: hold the
    head back and write it with the first body chunk (what a small HttpToolsProtocol subclass given
    to uvicorn.Config(http=...) would do)."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    original = RequestResponseCycle.send

    class _Capture:
        def __init__(self, real: Any, head: bytes | None) -> None:
            self.real, self.head, self.held = real, head, b""

        def write(self, data: bytes) -> None:
            if self.head is None:
                self.held += data
            else:
                self.real.write(self.head + data)
                self.head = None

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    async def send(self: Any, message: Any) -> None:
        head = getattr(self, "_held_head", None)
        if message["type"] == "http.response.start" or (head is not None and message["type"] == "http.response.body"):
            real = self.transport
            capture = _Capture(real, head if message["type"] == "http.response.body" else None)
            self.transport = capture
            try:
                await original(self, message)
            finally:
                self.transport = real
            self._held_head = capture.held if message["type"] == "http.response.start" else None
            if capture.head is not None:   # the body message wrote nothing: flush the head alone
                real.write(capture.head)
            return
        await original(self, message)

    RequestResponseCycle.send = send  # type: ignore[method-assign]


def _grpc_no_bdp() -> None:
    import gateway.engine_client as engine_client
    engine_client._CHANNEL_OPTIONS = [*engine_client._CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)]


def _asyncio_loop() -> None:
    import gateway.cli as cli
    cli.run = asyncio.run  # type: ignore[assignment]


PATCHES: dict[str, Callable[[], None]] = {
    "baseline": lambda: None, "telemetry_off": _telemetry_off, "gc_freeze": _gc_freeze,
    "no_watcher": _no_watcher, "no_metrics": _no_metrics, "asyncio_loop": _asyncio_loop, "one_write": _one_write,
    "grpc_no_bdp": _grpc_no_bdp, "unix_socket": lambda: None,   # engine side: see running_cluster(unix=)
    "chunk_all": lambda: None,   # engine-side: see stub_args()
}


def launch_patched(variant: str, gateway_argv: list[str]) -> None:
    from gateway import cli  # imported first so that patches replace what it holds

    for name in variant.split("+"):
        if name != "gc_freeze":
            PATCHES[name]()
    if "gc_freeze" in variant.split("+"):   # last: freeze what the imports and the other patches made
        _gc_freeze()
    cli.main(gateway_argv)


def stub_args(variant: str) -> tuple[str, ...]:
    return ("--tokens-per-chunk", "0") if "chunk_all" in variant.split("+") else ()


def measure(cluster: Cluster, concurrency: int, duration_s: float, max_tokens: int = 4) -> dict[str, Any]:
    meter = loadgen.CpuMeter({"gateway": [cluster.gateway_pid]})
    meter.start()
    body = json.dumps({**CHAT, "max_tokens": max_tokens}).encode()
    r = loadgen.wrk(f"{cluster.url}/v1/chat/completions", concurrency, duration_s, body)
    cpu = meter.stop()["gateway"]
    return {**r.as_dict(), "gateway_cpu_us_per_req": cpu / max(1, r.requests) * 1e6}


def run(variants: list[str], rounds: int, duration_s: float) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {"c64": [], "c1": [], "c64_mt64": []} for v in variants}
    with ExitStack() as stack:
        clusters = {}
        for v in variants:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"variant-{v}-")))
            command = [sys.executable, str(Path(__file__).resolve()), "--launch", v, "--"]
            clusters[v] = stack.enter_context(
                running_cluster("stub", 1, tmp, command, stub_args(v), unix="unix_socket" in v.split("+")))
        for v in variants:
            loadgen.wrk(f"{clusters[v].url}/v1/chat/completions", 16, 1, json.dumps(CHAT).encode())   # warm-up
        for r in range(rounds):
            for v in variants:
                cells = [("c64", 64, 4), ("c1", 1, 4)]
                if v in PER_TOKEN_VARIANTS:
                    cells.append(("c64_mt64", 64, 64))
                for key, c, max_tokens in cells:
                    res = measure(clusters[v], c, duration_s, max_tokens)
                    runs[v][key].append(res)
                    cpu_us = res["gateway_cpu_us_per_req"]
                    print(f"  round {r + 1} {v:36s} {key:8s} {res['rps']:7.0f} req/s  "
                          f"p50 {res['p50_us'] / 1000:6.3f} ms  gateway {cpu_us:5.0f} CPU µs/req", flush=True)
    summary = {}
    for v in variants:
        c64, c1, mt64 = runs[v]["c64"], runs[v]["c1"], runs[v]["c64_mt64"]
        summary[v] = {
            "rps_c64": statistics.median(x["rps"] for x in c64),
            "cpu_us_per_req_c64": statistics.median(x["gateway_cpu_us_per_req"] for x in c64),
            "p50_ms_c1": statistics.median(x["p50_us"] for x in c1) / 1000,
            "cpu_us_per_req_c1": statistics.median(x["gateway_cpu_us_per_req"] for x in c1),
        }
        if mt64:
            cpu64 = statistics.median(x["gateway_cpu_us_per_req"] for x in mt64)
            summary[v]["cpu_us_per_req_c64_max_tokens_64"] = cpu64
            summary[v]["cpu_us_per_extra_token"] = (cpu64 - summary[v]["cpu_us_per_req_c64"]) / 60
    base = summary.get("baseline")
    if base:
        for s in summary.values():
            s["cpu_saving_c64"] = 1 - s["cpu_us_per_req_c64"] / base["cpu_us_per_req_c64"]
            s["p50_saving_ms_c1"] = base["p50_ms_c1"] - s["p50_ms_c1"]
    return {"summary": summary, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:
        launch_patched(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run (< 30 s): two variants, 1 round of 1 s")
    p.add_argument("--variants", nargs="+", help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    p.add_argument("--rounds", type=int, help="default 6 (1 with --quick)")
    p.add_argument("--duration", type=float, help="seconds per measurement (whole seconds; default 1)")
    args = p.parse_args(argv)
    variants = args.variants or (["baseline", "telemetry_off+gc_freeze+no_watcher"] if args.quick
                                 else list(DEFAULT_VARIANTS))
    for v in variants:
        unknown = [n for n in v.split("+") if n not in PATCHES]
        if unknown:
            p.error(f"unknown patch {unknown[0]!r}; known: {', '.join(PATCHES)}")
    started = time.monotonic()
    result = run(variants, args.rounds or (1 if args.quick else 6), args.duration or 1.0)
    print(f"\n{'variant':36s} {'req/s c64':>9s} {'gw µs/req c64':>13s} {'saving':>7s} {'p50 ms c1':>9s} "
          f"{'Δp50 ms':>8s}")
    for v, s in result["summary"].items():
        print(f"{v:36s} {s['rps_c64']:9.0f} {s['cpu_us_per_req_c64']:13.0f} {s.get('cpu_saving_c64', 0):7.1%} "
              f"{s['p50_ms_c1']:9.3f} {s.get('p50_saving_ms_c1', 0):8.3f}")
    for v, s in result["summary"].items():
        if "cpu_us_per_extra_token" in s:
            print(f"{v}: max_tokens 64 at c=64: {s['cpu_us_per_req_c64_max_tokens_64']:.0f} gateway CPU µs/req, "
                  f"{s['cpu_us_per_extra_token']:.1f} µs per extra token")
    report = {"benchmark": "gateway_variants", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "git": git_state(), "wall_s": time.monotonic() - started, **result}
    save_report(OUT, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
