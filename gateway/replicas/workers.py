"""`gateway --workers N`: N gateway processes on one host, each a replica with its own sockets.

Every worker binds the HTTP and the gRPC (control + front door) ports itself with SO_REUSEPORT, so
the kernel spreads new connections over the live workers and a dead worker's share moves to the
others; they share cluster state through Redis (N > 1 without Redis is refused at start-up). This
parent process only starts the workers, restarts one that exits (after `RESTART_BACKOFF_S`), and
passes SIGINT/SIGTERM on; the worker holding the leader lease runs the managed engines.

A worker that cannot start (`gateway: cannot start`: Redis not reached, a port taken) exits with
`CANNOT_START`, which it uses only as a worker (`WORKER_ENV` set by this parent). At its first start the
parent then stops the others and exits 1, as one replica started alone does: restarting it would fail the
same way every `REDIS_START_WAIT_S`, for ever, and a supervisor (systemd, Kubernetes) would never see the
failure. A worker restarted later (it crashed while Redis was away, say) is restarted again: the others
still serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys

import structlog

from gateway.control.process_guard import ask_for_parent_death_signal

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
    """Run `count` workers until SIGINT/SIGTERM (0) or until one cannot start at its first start (1, the
    others stopped). A restarted worker that cannot start is restarted again: the others still serve."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running: dict[int, asyncio.subprocess.Process] = {}

    def reload() -> None:
        """A reload asked of the parent (README: `kill -HUP $GATEWAY_PID`): each worker reads its API keys
        again; workers share one fleet and refuse runtime changes. Without a handler the signal's default
        action stopped every worker and engine."""
        log.error("config_reload_refused", error="--workers: the fleet cannot change at runtime; restart to apply "
                  "the file (the workers read their API keys again)")
        for proc in running.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGHUP)

    loop.add_signal_handler(signal.SIGHUP, reload)
    cmd = worker_argv(argv)
    env = {**os.environ, WORKER_ENV: "1"}
    failed = False

    async def keep(i: int) -> None:
        nonlocal failed
        first = True
        while not stop.is_set():
            proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL, env=env,
                                                        preexec_fn=functools.partial(_stop_with, os.getpid()))
            log.info("worker_started", worker=i, pid=proc.pid)
            running[i] = proc
            code = await _run_until_stopped(proc, stop)
            running.pop(i, None)
            if stop.is_set():
                return
            if code == CANNOT_START and first:
                log.error("worker_cannot_start", worker=i, detail="stopping the other workers")
                failed = True
                stop.set()
                return
            first = False
            log.warning("worker_exited", worker=i, code=code, restart_in_s=RESTART_BACKOFF_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RESTART_BACKOFF_S)

    await asyncio.gather(*(keep(i) for i in range(count)))
    return 1 if failed else 0


def _stop_with(parent: int) -> None:
    """In a worker before it runs: SIGTERM (a graceful stop) when the parent dies, even by SIGKILL; killed
    that way, the workers served on, and a new gateway on the same ports shared them with the orphans."""
    # ignored (across exec) until the worker's own handler is in place: a reload forwarded to a worker still
    # starting would otherwise stop it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ask_for_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:   # the parent died before the line above took effect
        os._exit(1)


async def _run_until_stopped(proc: asyncio.subprocess.Process, stop: asyncio.Event) -> int:
    """The worker's exit status; once `stop` is set (before or while it runs), SIGTERM first, then SIGKILL
    after STOP_TIMEOUT_S. Each keeper stops its own worker: one spawned while the stop began is not missed."""
    exited = asyncio.ensure_future(proc.wait())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        return await exited
    finally:
        stopping.cancel()
