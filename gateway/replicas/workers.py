"""`gateway --workers N`: N gateway processes on one host, each a replica with its own sockets.

Every worker binds the HTTP and the gRPC (control + front door) ports itself with SO_REUSEPORT, so
the kernel spreads new connections over the live workers and a dead worker's share moves to the
others; they share cluster state through Redis (N > 1 without Redis is refused at start-up). This
parent process only starts the workers, restarts one that exits (after `RESTART_BACKOFF_S`), and
passes SIGINT/SIGTERM on; the worker holding the leader lease runs the managed engines.

A worker that cannot start (`gateway: cannot start`: Redis not reached, a port taken) exits with
`CANNOT_START`, which it uses only as a worker (`WORKER_ENV` set by this parent): the parent then stops the
others and exits 1, as one replica started alone does. Restarting it would fail the same way every
`REDIS_START_WAIT_S`, for ever, and a supervisor (systemd, Kubernetes) would never see the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import structlog

log = structlog.get_logger("workers")

RESTART_BACKOFF_S = 1.0
STOP_TIMEOUT_S = 60.0
WORKER_ENV = "HETEROGATE_WORKER"   # set for the workers: their exit status tells a failed start-up apart
CANNOT_START = 3


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other processes may bind too (Linux SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def worker_argv(argv: list[str]) -> list[str]:
    """The parent's command line for one worker: `--workers` dropped, `--reuse-port` added."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--workers":
            skip = i + 1 < len(argv)
        elif not arg.startswith("--workers="):
            out.append(arg)
    return [sys.executable, "-m", "gateway.cli", *out, "--reuse-port"]


async def run_workers(argv: list[str], count: int) -> int:
    """Run `count` workers until SIGINT/SIGTERM (0) or until one cannot start (1, the others stopped)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cmd = worker_argv(argv)
    env = {**os.environ, WORKER_ENV: "1"}
    procs: list[asyncio.subprocess.Process | None] = [None] * count
    failed = False

    async def keep(i: int) -> None:
        nonlocal failed
        while not stop.is_set():
            proc = procs[i] = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL, env=env)
            log.info("worker_started", worker=i, pid=proc.pid)
            code = await proc.wait()
            if stop.is_set():
                return
            if code == CANNOT_START:
                log.error("worker_cannot_start", worker=i, detail="stopping the other workers")
                failed = True
                stop.set()
                return
            log.warning("worker_exited", worker=i, code=code, restart_in_s=RESTART_BACKOFF_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RESTART_BACKOFF_S)

    keepers = [asyncio.create_task(keep(i)) for i in range(count)]
    await stop.wait()
    running = [p for p in procs if p is not None and p.returncode is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), STOP_TIMEOUT_S)
    except TimeoutError:
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    await asyncio.gather(*keepers, return_exceptions=True)
    return 1 if failed else 0
