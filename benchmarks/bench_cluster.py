"""A gateway process and its fast engines on loopback, for the overhead benchmarks.

Two kinds of engine:
    stub  benchmarks/stub_engine.py processes, external backends (`address:` in backends.yaml);
    sim   real `backends.engine` processes launched by the gateway with `time_scale: 0`.
The gateway is started by testkit.harness.run_gateway (free ports, `--log-level warning`), or, for
the variant experiments, by `launch` (the same, with another command in place of `-m gateway.cli`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from testkit.harness import Gateway, free_port, run_gateway, stop_process, write_config  # noqa: E402

EngineKind = Literal["stub", "sim"]
MODEL = "llava-1.5-7b"


@dataclass(frozen=True)
class Cluster:
    engine: EngineKind
    gateway: Gateway
    addresses: list[str]
    engine_pids: list[int]

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def gateway_pid(self) -> int:
        return self.gateway.process.pid


def cluster_config(engine: EngineKind, addresses: list[str]) -> dict[str, Any]:
    backends: list[dict[str, Any]]
    if engine == "stub":
        backends = [{"id": f"e{i}", "role": "language", "gpu": "H100", "address": a} for i, a in enumerate(addresses)]
    else:
        backends = [{"id": f"e{i}", "role": "language", "gpu": "H100", "launch": {"time_scale": 0}}
                    for i in range(len(addresses))]
    return {"model": MODEL, "gateway": {"routing": {"policy": "heteroserve"}}, "backends": backends}


@contextmanager
def launch(config: Path, command: list[str], cwd: Path = ROOT) -> Iterator[Gateway]:
    """`command --backends config --port .. --grpc-port .. --log-level warning` until the block ends.
    `cwd`: where it runs; `python -m` there imports that checkout's code (and so do the engines it launches)."""
    port, grpc_port = free_port(), free_port()
    log_path = config.parent / "gateway.log"
    cmd = [*command, "--backends", str(config), "--port", str(port), "--grpc-port", str(grpc_port),
           "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    gw = Gateway(proc, f"http://127.0.0.1:{port}", grpc_port, log_path)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log_tail()}")
            try:
                return httpx.get(f"{gw.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        gw.wait_until(up, timeout=60, interval=0.2)
        yield gw
    finally:
        stop_process(proc)


@contextmanager
def running_cluster(
    engine: EngineKind, backends: int, tmp: Path, gateway_command: list[str] | None = None,
    stub_args: tuple[str, ...] = (), unix: bool = False, cwd: Path = ROOT,
) -> Iterator[Cluster]:
    """Start the gateway and `backends` engines; wait until every backend heartbeats; stop all on exit.

    `unix`: stub engines listen on Unix-domain sockets in `tmp` instead of loopback TCP.
    `cwd`: the checkout the gateway (with `gateway_command`) and the engines it launches run from.
    """
    listen = [["--unix", str(tmp / f"e{i}.sock")] if unix else ["--port", str(free_port())] for i in range(backends)]
    addresses = [f"unix:{a[1]}" if unix else f"127.0.0.1:{a[1]}" for a in listen]
    config = write_config(tmp, cluster_config(engine, addresses))
    with ExitStack() as stack:
        if gateway_command is not None:
            gw = stack.enter_context(launch(config, gateway_command, cwd))
        else:
            gw = stack.enter_context(run_gateway(config, healthy=0 if engine == "stub" else backends))
        if engine == "stub":
            for i, where in enumerate(listen):
                log = stack.enter_context(open(tmp / f"stub-e{i}.log", "wb"))
                proc = subprocess.Popen(
                    [sys.executable, str(ROOT / "benchmarks" / "stub_engine.py"), "--backend-id", f"e{i}",
                     "--gateway", f"127.0.0.1:{gw.grpc_port}", *where, *stub_args],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                )
                stack.callback(stop_process, proc)
        infos = gw.wait_until(
            lambda: (bs := gw.backends()) and all(b["healthy"] for b in bs) and bs, timeout=30)
        yield Cluster(engine, gw, [b["address"] for b in infos], [int(b["pid"]) for b in infos])
