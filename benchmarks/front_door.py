"""The front door side by side with the Rust routers, in front of the same fast engines, in one run.

    python benchmarks/front_door.py [--quick] [--rounds 3] [--duration 5] [--no-peers | --managed-only]
                                    [--baseline DIR] [--python EXE ...] [--out FILE]
    python benchmarks/front_door.py --pairs N [--duration 4] [--baseline DIR] [--python EXE ...] [--tracing]
                                    [--out FILE]
    python benchmarks/front_door.py --from FILE      # the tables of a results file again, nothing run

Targets, each in front of two mock OpenAI engines on loopback (benchmarks/mock_openai_engine.py):

    direct              wrk straight to one mock engine (the floor)
    io-floor            benchmarks/io_floor_proxy.py: the gateway's own HTTP server and upstream client
                        forwarding bytes in turn, no gateway logic (what the gateway's I/O costs)
    vllm-router         vllm-router --policy round_robin      (PyPI, in its own venv)
    sglang-router       sglang_router.launch_router --policy round_robin (PyPI, same venv)
    heterogate-openai   the gateway with the two engines as `kind: openai` backends
    heterogate-openai-2w  the same with `gateway --workers 2` on one Redis (--workers-redis-url; both
                        cores, as the Rust routers' threads use them)
    heterogate-managed  the gateway with two managed simulated engines (gRPC, `time_scale: 0`)

The routers are installed on first use into benchmarks/.peers-venv (`pip install vllm-router
sglang-router`); `--no-peers` leaves them out, `--managed-only` leaves them and `heterogate-openai` out.
`--baseline DIR` adds `heterogate-managed@base` and (unless `--managed-only`) `heterogate-openai@base`,
the same targets run from another checkout (`git archive <commit> | tar -x -C DIR`), for before and
after in one run. `--python EXE` (repeatable) adds `heterogate-openai@pyX.Y.Z`, `heterogate-openai-2w@pyX.Y.Z`
and `heterogate-managed@pyX.Y.Z`: this checkout's gateway on another CPython build (its engines too);
the mocks, the load and the peers stay as they are. A base interpreter gets a venv of its own with this
checkout installed, made on first use in benchmarks/.gateway-venvs/; a venv's interpreter is used as
it is. Why: the gateway's CPU a request depends on how the interpreter was built (docs/FRONT_DOOR.md,
"The interpreter"), and the interpreter that runs this script may not be the one the gateway is
deployed on. `--tracing` adds `heterogate-openai@otel` (OpenTelemetry on, every request traced),
`heterogate-openai@otel-0.1` and `@otel-0.01` (`parentbased_traceidratio` at 0.1 and 0.01): this checkout
with the OTEL_* variables set, exporting OTLP/HTTP to a receiver in this script that counts and drops
what it gets.
Every interpreter in the run is recorded in the results (`interpreters`), with the
seconds it takes for the same plain-Python loop (`probe_s`). `--pairs N` measures only the builds'
`heterogate-openai` targets against each other: the non-streamed rate at c=64 and the CPU a request,
N rounds in rotating order, with each build's ratio to this checkout round by round (a tenth or two between
builds is within the spread of the full table's three rounds on a noisy machine); `--pairs-managed`
adds their managed targets (`--managed-only`: only those). Cells, each the median
over rounds (targets alternate within a round, so background load hits them alike):

    rps64     req/s at c=64, non-streamed, max_tokens 4          (wrk)
    rps64s    req/s at c=64, streamed, 32 chunks                 (wrk)
    p50/p99   latency at c=1 and c=16, non-streamed; "added" = target − direct
    ttft      streaming time to the first event at c=1, p50      (aiohttp client)
    cpu/req   CPU µs of the router process per non-streamed request at c=64 (/proc)
    engine    CPU µs of the managed engines per non-streamed request at c=64 (managed targets)
    errors    socket errors + non-2xx over every run

Writes benchmarks/results/front_door.json and prints the table that docs/FRONT_DOOR.md quotes, then
each gateway target's ratios to vllm-router round by round (the targets: its share of vllm-router's
req/s, its added p50 at c=1 against vllm-router's), since one run's medians can rest on one round.
`--pairs` writes benchmarks/results/front_door_pairs.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from benchmarks import loadgen  # noqa: E402
from benchmarks.bench_cluster import launch, running_cluster, stop_process  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from testkit.harness import free_port, run_gateway, write_config  # noqa: E402

PEERS_VENV = ROOT / "benchmarks" / ".peers-venv"
GATEWAY_VENVS = ROOT / "benchmarks" / ".gateway-venvs"
RESULTS = ROOT / "benchmarks" / "results" / "front_door.json"
PAIRS_RESULTS = ROOT / "benchmarks" / "results" / "front_door_pairs.json"
MODEL = "mock"
PROMPT = [{"role": "user", "content": "Hello there, how are you today?"}]


def body(max_tokens: int, stream: bool, model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": stream}).encode()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            httpx.post(url, content=body(1, False), headers={"content-type": "application/json"}, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def ensure_peers() -> Path:
    bin_dir = PEERS_VENV / "bin"
    if not (bin_dir / "vllm-router").exists():
        print("installing vllm-router and sglang-router into", PEERS_VENV)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", "vllm-router", "sglang-router"], check=True)
    return bin_dir


@dataclass(frozen=True)
class GatewayBuild:
    """One way to run the gateway's processes: a checkout's code on an interpreter. `suffix` goes after
    each of its targets' names ("" for this checkout on this script's interpreter)."""

    suffix: str
    checkout: Path = ROOT
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()   # added to the gateway's environment (kind: openai targets only)

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "gateway.cli"]

    @property
    def default(self) -> bool:
        return self.checkout == ROOT and self.python == sys.executable


@contextmanager
def otlp_sink() -> Iterator[tuple[str, dict[str, int]]]:
    """An OTLP/HTTP endpoint that takes every export and drops it, counting requests and bytes (in this
    process: its CPU is not the gateway's)."""
    counts = {"exports": 0, "bytes": 0}

    class Sink(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            counts["bytes"] += len(self.rfile.read(int(self.headers.get("content-length", 0))))
            counts["exports"] += 1
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        server.server_close()


TRACE_RATIOS = (0.1, 0.01)   # the sampled tracing targets' OTEL_TRACES_SAMPLER_ARG


def tracing_builds(endpoint: str) -> list[GatewayBuild]:
    """This checkout with tracing on: every request traced (`@otel`), and a share of them (`@otel-<ratio>`)."""
    env = (("OTEL_TRACES_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint))
    return [GatewayBuild("@otel", env=env), *(
        GatewayBuild(f"@otel-{ratio:g}", env=(*env, ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                                              ("OTEL_TRACES_SAMPLER_ARG", str(ratio)))) for ratio in TRACE_RATIOS)]


# The same plain-Python loop in every interpreter of a run: how fast each runs Python code, at that moment.
PROBE = """
import time
class S:
    __slots__ = ("a", "b")
    def __init__(self, a, b): self.a, self.b = a, b
def loop():
    t0 = time.process_time()
    total = 0
    for i in range(500_000):
        s = S(i, i + 1)
        total += s.b + len({"k": i, "v": s.a})
    return time.process_time() - t0
print(min(loop() for _ in range(3)))
"""
INFO = ("import json, platform, sys, sysconfig; print(json.dumps({'executable': sys.executable, "
        "'version': platform.python_version(), 'venv': sys.prefix != sys.base_prefix, "
        "'shared_libpython': bool(sysconfig.get_config_var('Py_ENABLE_SHARED')), "
        "'libpython_mapped': any('libpython' in line for line in open('/proc/self/maps')), "
        "'config_args': sysconfig.get_config_var('CONFIG_ARGS')}))")


def describe(python: str) -> dict[str, Any]:
    """What `python` is: version, venv or not, how it was configured."""
    info: dict[str, Any] = json.loads(subprocess.run([python, "-c", INFO], capture_output=True, text=True,
                                                     check=True, timeout=60).stdout)
    return info


def interpreter(python: str) -> dict[str, Any]:
    """`describe(python)` and its probe time in seconds, for the results file."""
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    return {**describe(python), "probe_s": float(probe.stdout)}


def gateway_python(python: str) -> GatewayBuild:
    """The build of this checkout on `python`: a venv's interpreter as it is; a base interpreter through a
    venv of its own with this checkout installed, made on first use."""
    info = describe(python)
    if not info["venv"]:
        venv = GATEWAY_VENVS / Path(info["executable"]).resolve().as_posix().strip("/").replace("/", "_")
        exe = venv / "bin" / "python"
        if not exe.exists():
            print(f"making a venv of {python} with this checkout installed in {venv}")
            subprocess.run([python, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(exe), "-m", "pip", "install", "-q", "-e", str(ROOT)], check=True)
        python = str(exe)
    return GatewayBuild(f"@py{info['version']}", ROOT, python)


@contextmanager
def process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        yield proc
    finally:
        stop_process(proc)


def mock_engines(stack: ExitStack, tmp: Path, n: int = 2) -> list[str]:
    """`n` fast mock engines (mock_openai_engine.py) on free ports for the rest of `stack`: their URLs."""
    urls = []
    for _ in range(n):
        port = free_port()
        proc = stack.enter_context(process(
            [sys.executable, str(ROOT / "benchmarks" / "mock_openai_engine.py"), "--port", str(port)],
            tmp / f"mock-{port}.log"))
        urls.append(f"http://127.0.0.1:{port}")
        wait_http(f"{urls[-1]}/v1/chat/completions", proc)
    return urls


class Target:
    def __init__(self, name: str, url: str, pid: int, model: str = MODEL, engine_pids: tuple[int, ...] = ()) -> None:
        self.name, self.url, self.pid, self.model, self.engine_pids = name, url, pid, model, engine_pids


def managed_target(stack: ExitStack, tmp: Path, build: GatewayBuild) -> Target:
    """The gateway with two managed simulated engines, both run by `build` (the engines on its interpreter)."""
    name = f"heterogate-managed{build.suffix}"
    (tmp / name).mkdir()
    command = None if build.default else build.command
    cluster = stack.enter_context(running_cluster("sim", 2, tmp / name, command, cwd=build.checkout.resolve()))
    return Target(name, cluster.url, cluster.gateway_pid, "llava-1.5-7b", tuple(cluster.engine_pids))


def openai_config(tmp: Path, urls: list[str], **gateway: Any) -> Path:
    """The two mocks as kind: openai backends."""
    return write_config(tmp, {
        "model": "llava-1.5-7b", "served_model_name": MODEL, **({"gateway": gateway} if gateway else {}),
        "backends": [{"id": f"up{i}", "kind": "openai", "role": "language", "gpu": "H100", "address": u}
                     for i, u in enumerate(urls)],
    })


def start_targets(
    stack: ExitStack, tmp: Path, peers: bool, openai: bool = True, builds: tuple[GatewayBuild, ...] = (),
    workers_redis: str | None = None, managed: bool = True,
) -> list[Target]:
    """`builds`: the gateway's builds beside this checkout on this interpreter (`--baseline`, `--python`)."""
    builds = (GatewayBuild(""), *builds)
    urls = mock_engines(stack, tmp)
    targets = [Target("direct", urls[0], 0)]
    if openai:
        port = free_port()
        proc = stack.enter_context(process(
            [sys.executable, str(ROOT / "benchmarks" / "io_floor_proxy.py"), "--port", str(port), *urls],
            tmp / "io-floor.log"))
        wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", proc)
        targets.append(Target("io-floor", f"http://127.0.0.1:{port}", proc.pid))
    if peers:
        bin_dir = ensure_peers()
        for name, cmd in (
            ("vllm-router", [str(bin_dir / "vllm-router"), "--policy", "round_robin", "--log-level", "warning"]),
            ("sglang-router", [str(bin_dir / "python"), "-m", "sglang_router.launch_router",
                               "--policy", "round_robin", "--log-level", "warn"]),
        ):
            port = free_port()
            proc = stack.enter_context(process(
                [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                 "--worker-urls", *urls], tmp / f"{name}.log"))
            wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", proc)
            targets.append(Target(name, f"http://127.0.0.1:{port}", proc.pid))
    for build in builds if openai else ():
        name = f"heterogate-openai{build.suffix}"
        (tmp / name).mkdir()
        config = openai_config(tmp / name, urls)
        if build.default:
            gw = stack.enter_context(run_gateway(config, healthy=0, env=dict(build.env)))
        else:   # `python -m` in the build's checkout imports its code
            gw = stack.enter_context(launch(config, build.command, build.checkout.resolve()))
        targets.append(Target(name, gw.url, gw.process.pid))
    # Both cores, as the Rust routers use them: two workers sharing state (not for an older checkout,
    # whose workers may not exist)
    for build in [b for b in builds if b.checkout == ROOT and not b.env] if openai and workers_redis else ():
        name = f"heterogate-openai-2w{build.suffix}"
        (tmp / name).mkdir()
        config = openai_config(tmp / name, urls,
                               redis={"key_prefix": f"heterogate-front-door-{os.getpid()}{build.suffix}:"})
        gw = stack.enter_context(launch(config, [*build.command, "--workers", "2", "--redis-url", workers_redis]))
        wait_http(f"{gw.url}/v1/chat/completions", gw.process)
        targets.append(Target(name, gw.url, 0))   # two processes: no CPU column
    for build in [b for b in builds[::-1] if not b.env] if managed else ():
        targets.append(managed_target(stack, tmp, build))
    return targets


async def _ttft(url: str, model: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body(32, True, model),
                                    headers={"content-type": "application/json"}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        out.append(time.perf_counter() - t0)
                        break
                await resp.read()
    return sorted(out)


def measure_rate(t: Target, duration_s: float) -> dict[str, Any]:
    """req/s at c=64, non-streamed, and the CPU a request of the target's process (and its engines)."""
    row: dict[str, Any] = {}
    before = loadgen.cpu_ticks(t.pid) if t.pid else 0
    engines_before = sum(map(loadgen.cpu_ticks, t.engine_pids))
    r = loadgen.wrk(t.url + "/v1/chat/completions", 64, duration_s, body(4, False, t.model))
    if t.pid:
        row["cpu_us_per_req"] = (loadgen.cpu_ticks(t.pid) - before) / loadgen.CLK_TCK / max(1, r.requests) * 1e6
    if t.engine_pids:
        engines = sum(map(loadgen.cpu_ticks, t.engine_pids)) - engines_before
        row["engine_cpu_us_per_req"] = engines / loadgen.CLK_TCK / max(1, r.requests) * 1e6
    row["rps64"], row["errors"] = r.rps, r.errors
    return row


def measure(t: Target, duration_s: float, ttft_n: int) -> dict[str, Any]:
    url = t.url + "/v1/chat/completions"
    row = measure_rate(t, duration_s)
    errors = row.pop("errors")
    r = loadgen.wrk(url, 64, duration_s, body(32, True, t.model))
    row["rps64s"], errors = r.rps, errors + r.errors
    for c in (1, 16):
        r = loadgen.wrk(url, c, duration_s, body(4, False, t.model))
        row[f"p50_c{c}_ms"], row[f"p99_c{c}_ms"] = r.p50_us / 1000, r.p99_us / 1000
        errors += r.errors
    ttft = asyncio.run(_ttft(t.url, t.model, ttft_n))
    row["ttft_p50_ms"] = loadgen.percentile(ttft, 50) * 1000
    row["errors"] = errors
    return row


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        keys = rounds[0][name].keys()
        out[name] = {k: (sum if k == "errors" else statistics.median)([r[name][k] for r in rounds]) for k in keys}
    direct = out["direct"]
    for row in out.values():
        for c in (1, 16):
            row[f"added_p50_c{c}_ms"] = row[f"p50_c{c}_ms"] - direct[f"p50_c{c}_ms"]
            row[f"added_p99_c{c}_ms"] = row[f"p99_c{c}_ms"] - direct[f"p99_c{c}_ms"]
    return out


def print_table(summary: dict[str, dict[str, float]], say: Callable[[str], None] = print) -> None:
    cols = [("req/s c=64", "rps64", "{:,.0f}"), ("req/s c=64 stream", "rps64s", "{:,.0f}"),
            ("added p50 c=1 ms", "added_p50_c1_ms", "{:.2f}"), ("added p99 c=1 ms", "added_p99_c1_ms", "{:.2f}"),
            ("added p50 c=16 ms", "added_p50_c16_ms", "{:.2f}"), ("added p99 c=16 ms", "added_p99_c16_ms", "{:.2f}"),
            ("TTFT p50 ms", "ttft_p50_ms", "{:.2f}"), ("CPU µs/req", "cpu_us_per_req", "{:,.0f}"),
            ("engine CPU µs/req", "engine_cpu_us_per_req", "{:,.0f}"), ("errors", "errors", "{:.0f}")]
    say("| target | " + " | ".join(c[0] for c in cols) + " |")
    say("|---|" + "---:|" * len(cols))
    for name, row in summary.items():
        cells = [fmt.format(row[key]) if key in row else "—" for _, key, fmt in cols]
        say(f"| {name} | " + " | ".join(cells) + " |")


# The targets for the gateway against vllm-router: (target, bound, whether the ratio must reach it)
TARGETS = (("non-streamed share of vllm-router", 0.5, True), ("streamed share of vllm-router", 0.5, True),
           ("added p50 c=1, times vllm-router's", 2.0, False))


def target_checks(runs: list[dict[str, dict[str, Any]]], gateway: str = "heterogate-openai",
                  peer: str = "vllm-router") -> dict[str, list[float]] | None:
    """The targets' ratios of `gateway` to `peer`, one per round: both ran in that round, back to back,
    so a ratio per round shows how much of a run's verdict rests on the machine's moment (the peer's
    rate moved by half between rounds of one run). None when either target is not in the run."""
    if gateway not in runs[0] or peer not in runs[0]:
        return None
    out: dict[str, list[float]] = {name: [] for name, _, _ in TARGETS}
    for run in runs:
        row, base, direct = run[gateway], run[peer], run["direct"]["p50_c1_ms"]
        ratios = (_ratio(row["rps64"], base["rps64"]), _ratio(row["rps64s"], base["rps64s"]),
                  _ratio(row["p50_c1_ms"] - direct, base["p50_c1_ms"] - direct))
        for (name, _, _), ratio in zip(TARGETS, ratios, strict=True):
            out[name].append(ratio)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def print_targets(checks: dict[str, list[float]], gateway: str, say: Callable[[str], None] = print) -> None:
    rounds = len(checks[TARGETS[0][0]])
    say(f"\n{gateway} against vllm-router, round by round:")
    say("| target | bound | " + " | ".join(f"round {i + 1}" for i in range(rounds)) + " | met in |")
    say("|---|---:|" + "---:|" * (rounds + 1))
    for name, bound, at_least in TARGETS:
        values = checks[name]
        fmt = "{:.0%}" if at_least else "{:.2f}×"
        met = sum(v >= bound if at_least else v <= bound for v in values)
        say(f"| {name} | {'≥' if at_least else '≤'} {fmt.format(bound)} | " +
            " | ".join(fmt.format(v) for v in values) + f" | {met} of {rounds} |")


def print_checks(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Each gateway target's checks against the targets, printed; returned for the results file."""
    checks = {name: c for name in runs[0] if name.startswith("heterogate-openai") and not name.endswith("@base")
              and (c := target_checks(runs, name)) is not None}
    for name, c in checks.items():
        print_targets(c, name)
    return checks


def run_rounds(targets: list[Target], rounds: int, duration_s: float, ttft_n: int) -> list[dict[str, dict[str, Any]]]:
    """Every target once per round, in alternating order, so a change of background load hits them alike."""
    runs = []
    for i in range(rounds):
        order = targets if i % 2 == 0 else targets[::-1]
        run = {}
        for t in order:
            print(f"round {i + 1}/{rounds}: {t.name}", flush=True)
            run[t.name] = measure(t, duration_s, ttft_n)
        runs.append({t.name: run[t.name] for t in targets})
    return runs


def run_pairs(targets: list[Target], pairs: int, duration_s: float) -> list[dict[str, dict[str, Any]]]:
    """Only the non-streamed rate at c=64 and the CPU a request, `pairs` rounds, the targets in turn:
    a difference of a tenth or two between builds of the gateway is within the full table's spread over
    three rounds on a noisy machine, but shows in the same round's ratio, round after round. The order
    rotates from round to round, so that each target runs first, in the middle and last alike (reversed
    rounds would keep the middle one of three in the middle every time)."""
    rounds = []
    for i in range(pairs):
        k = i % len(targets)
        order = targets[k:] + targets[:k]
        row = {}
        for t in order:
            print(f"pair {i + 1}/{pairs}: {t.name}", flush=True)
            row[t.name] = measure_rate(t, duration_s)
        rounds.append({t.name: row[t.name] for t in targets})
    return rounds


def print_pairs(rounds: list[dict[str, dict[str, Any]]], say: Callable[[str], None] = print) -> dict[str, Any]:
    """Each round's CPU a request and req/s, then each build's medians and its ratios to this checkout's
    target of the same kind (`heterogate-openai@X` to `heterogate-openai`)."""
    names = list(rounds[0])
    say("| round | " + " | ".join(f"{n} µs/req (req/s)" for n in names) + " |")
    say("|---:|" + "---:|" * len(names))
    for i, row in enumerate(rounds):
        say(f"| {i + 1} | " + " | ".join(f"{row[n]['cpu_us_per_req']:,.0f} ({row[n]['rps64']:,.0f})" for n in names)
            + " |")
    out: dict[str, Any] = {}
    say("\n| build | CPU µs/req, median | req/s, median | CPU ratio to this checkout, median | less CPU |")
    say("|---|---:|---:|---:|---:|")
    for n in names:
        first = n.partition("@")[0]
        cpu = [r[n]["cpu_us_per_req"] / r[first]["cpu_us_per_req"] for r in rounds]
        out[n] = {"cpu_us_per_req": statistics.median(r[n]["cpu_us_per_req"] for r in rounds),
                  "rps64": statistics.median(r[n]["rps64"] for r in rounds),
                  "cpu_ratio": statistics.median(cpu), "rounds_with_less_cpu": sum(c < 1 for c in cpu)}
        say(f"| {n} | {out[n]['cpu_us_per_req']:,.0f} | {out[n]['rps64']:,.0f} | {out[n]['cpu_ratio']:.2f} | "
            f"{out[n]['rounds_with_less_cpu']} of {len(rounds)} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    p.add_argument("--quick", action="store_true", help="1 round of 2 s runs")
    p.add_argument("--no-peers", action="store_true", help="leave vllm-router and sglang-router out")
    p.add_argument("--managed-only", action="store_true", help="only direct and the managed target(s)")
    p.add_argument("--baseline", type=Path,
                   help="also run the managed and kind: openai targets from this checkout (before/after)")
    p.add_argument("--python", action="append", default=[], metavar="EXE",
                   help="also run the gateway's targets on this interpreter (repeatable; a base interpreter "
                        "gets a venv of its own in benchmarks/.gateway-venvs)")
    p.add_argument("--pairs", type=int, metavar="N",
                   help="instead of the table: only the gateway's builds (this checkout, --baseline, --python), "
                        "kind: openai, non-streamed at c=64, N rounds in turn; CPU a request and ratios per round")
    p.add_argument("--tracing", action="store_true",
                   help="also run this checkout's kind: openai target with OpenTelemetry on (all requests, "
                        "1 in 10, 1 in 100), exporting to a receiver in this script")
    p.add_argument("--pairs-managed", action="store_true",
                   help="with --pairs: the managed targets too (--managed-only: only them)")
    p.add_argument("--out", type=Path, help=f"results file (default: {RESULTS.relative_to(ROOT)}, "
                                             f"with --pairs {PAIRS_RESULTS.relative_to(ROOT)})")
    p.add_argument("--workers-redis-url", default="redis://127.0.0.1:6379/0",
                   help="Redis for the `gateway --workers 2` target (empty: leave that target out)")
    p.add_argument("--from", dest="saved", type=Path, help="print the tables of this results file; run nothing")
    args = p.parse_args(argv)
    if args.saved is not None:
        saved = json.loads(args.saved.read_text())
        if "pairs" in saved:
            print_pairs(saved["pairs"])
            return 0
        print_table(saved["summary"])
        print_checks(saved["runs"])
        return 0
    with ExitStack() as script:   # the OTLP sink lives as long as the run
        sink, exported = script.enter_context(otlp_sink()) if args.tracing else ("", {})
        return run(args, sink, exported)


def run(args: argparse.Namespace, sink: str, exported: dict[str, int]) -> int:
    """The run `args` ask for; `sink`: the OTLP endpoint of the tracing targets, whose counts are `exported`."""
    rounds, duration = (1, 2.0) if args.quick else (args.rounds, args.duration)
    started = time.monotonic()
    builds = [gateway_python(exe) for exe in args.python]
    if args.baseline is not None:
        builds.insert(0, GatewayBuild("@base", args.baseline))
    if args.tracing:
        builds += tracing_builds(sink)
    interpreters: dict[str, dict[str, Any]] = {}   # by path: this script's, then each --python's venv
    for build in [GatewayBuild(""), *builds]:
        if build.python not in interpreters:
            interpreters[build.python] = interpreter(build.python)
    report: dict[str, Any] = {"cpus": os.cpu_count(), "git": git_state(), "interpreters": interpreters,
                              **({"otlp_exported": exported} if args.tracing else {})}
    if args.pairs:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            targets = start_targets(stack, Path(tmp), False, openai=not args.managed_only, builds=tuple(builds),
                                    managed=args.managed_only or args.pairs_managed)
            pairs = run_pairs([t for t in targets if t.name.startswith(("heterogate-openai", "heterogate-managed"))],
                              args.pairs, args.duration)
        medians = print_pairs(pairs)
        save_report(args.out or PAIRS_RESULTS, {"wall_s": time.monotonic() - started,
                                                "duration_s": args.duration, **report, "medians": medians,
                                                "pairs": pairs})
        return 0
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        targets = start_targets(stack, Path(tmp), not (args.no_peers or args.managed_only),
                                openai=not args.managed_only, builds=tuple(builds),
                                workers_redis=args.workers_redis_url or None)
        runs = run_rounds(targets, rounds, duration, 50 if args.quick else 200)
    summary = summarise(runs)
    print_table(summary)
    checks = print_checks(runs)
    save_report(args.out or RESULTS, {"wall_s": time.monotonic() - started, "rounds": rounds,
                                      "duration_s": duration, **report, "summary": summary,
                                      "targets_by_round": checks, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
