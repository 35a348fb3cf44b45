"""Launches the managed backends of backends.yaml, restarts them when they die, stops them all on exit.

Each managed backend has a `Launcher` (`gateway.control.launchers`) that says what to run and when it is
ready. A backend is `starting` from launch until ready (at most the launcher's start timeout, after
which it is stopped and launched again), `ready` while it runs, `restarting` during the backoff after
an exit, and `stopped` once the gateway stops. Each exit is reported in words (`exit_reason`: its status,
the signal that killed it, or the start timeout) through `on_exit`, for /admin/backends: an engine that
restarts for ever says why without the operator reading the logs. The backoff doubles from `backoff_min_s` to
`backoff_max_s` and resets once a backend has stayed up for `stable_after_s`.

Processes start through `gateway.control.process_guard`: each engine gets a process group of its own,
which is stopped as a whole (SIGTERM, SIGKILL after the grace period) when it is stopped or its
leader dies, and which is taken down by the kernel's parent-death signal if the gateway is killed,
even with SIGKILL. With replicas (`LaunchPlan.outlive_parent`) the guards outlive a gateway that is killed, and
the next leader starts its supervisor with the engines it adopted (gateway/control/adoption.py):
those are `ready` from the start and relaunched only once they exit.

Time and processes come in through `Clock` and `Spawner`, so the state machine is tested without
sleeps or real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from gateway.control.launchers import Launcher
from gateway.routing.backend_entry import Lifecycle

log = structlog.get_logger("supervisor")

class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class Process(Protocol):
    """A launched process guard, or one adopted from an earlier leader (adoption.AdoptedProcess)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Spawner(Protocol):
    async def spawn(self, argv: list[str], env: dict[str, str], *, outlive_parent: bool = False) -> Process: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class GuardedSpawner:
    """Real processes, each under a `process_guard` that leads a session of its own (and, with
    `outlive_parent`, keeps its engine running when this gateway dies)."""

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s

    async def spawn(self, argv: list[str], env: dict[str, str], *, outlive_parent: bool = False) -> Process:
        guard = [sys.executable, "-m", "gateway.control.process_guard", "--parent", str(os.getpid()),
                 "--grace-s", str(self._grace_s), *(["--outlive-parent"] if outlive_parent else []), "--"]
        return await asyncio.create_subprocess_exec(
            *guard, *argv, env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )


@dataclass
class Child:
    launcher: Launcher
    state: Lifecycle = "starting"
    process: Process | None = None
    restarts: int = 0
    outlives: bool = False   # its process keeps running without this gateway (launched so, or adopted)
    last_exit: str | None = None   # why it last stopped serving, in words (`exit_reason`)
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def backend_id(self) -> str:
        return self.launcher.backend_id


def exit_reason(code: int) -> str:
    """An engine's exit status in words. Engines run under `process_guard`, which exits with 128 + N when
    signal N killed the engine (the shell's convention); a negative code is a signal that killed the guard."""
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        with contextlib.suppress(ValueError):
            return f"exited with status {code} (killed by {signal.Signals(number).name})"
    if code == 127:
        return "exited with status 127 (the launch program was not found or could not start)"
    return f"exited with status {code}"


class Supervisor:
    def __init__(
        self,
        launchers: list[Launcher],
        *,
        on_state: Callable[[str, Lifecycle], None] = lambda backend_id, state: None,
        clock: Clock | None = None,
        spawner: Spawner | None = None,
        backoff_min_s: float = 0.25,
        backoff_max_s: float = 10.0,
        stable_after_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        adopted: Mapping[str, Process] | None = None,
        on_launch: Callable[[str], None] = lambda backend_id: None,
        on_exit: Callable[[str, str], None] = lambda backend_id, reason: None,
        on_spawn: Callable[[str, int], None] = lambda backend_id, pid: None,
    ) -> None:
        """`adopted`: backend id -> its running engine's guard, taken over from an earlier leader.
        `on_launch(backend_id)`: called before each launch (the engine's identity changes hands).
        `on_exit(backend_id, reason)`: called when a backend stops serving unasked, with why in words.
        `on_spawn(backend_id, pid)`: its process is running (launched or adopted), for /admin/backends."""
        self._children = [Child(launcher) for launcher in launchers]
        self._adopted = dict(adopted or {})
        self._on_launch = on_launch
        self._on_state = on_state
        self._on_exit = on_exit
        self._on_spawn = on_spawn
        self._clock = clock or MonotonicClock()
        # The guard's SIGTERM → SIGKILL delay fits inside the supervisor's own stop timeout.
        self._spawner = spawner or GuardedSpawner(grace_s=stop_timeout_s / 2)
        self._backoff = (backoff_min_s, backoff_max_s)
        self._stable_after_s = stable_after_s
        self._stop_timeout_s = stop_timeout_s
        self._stopping = False
        self._started = False

    @property
    def children(self) -> list[Child]:
        return self._children

    def start(self) -> None:
        self._started = True
        for child in self._children:
            self._start_child(child)

    def _start_child(self, child: Child) -> None:
        adopted = child.process = self._adopted.pop(child.backend_id, None)
        child.outlives = adopted is not None
        # an adopted engine serves on: "ready" keeps its last heartbeat, "starting" would drop it
        self._set(child, "ready" if adopted is not None else "starting")
        child.task = asyncio.create_task(self._keep_running(child, adopted), name=f"supervise-{child.backend_id}")

    def add(self, launcher: Launcher) -> None:
        """Supervise one more backend (added to the fleet at runtime): launched now if supervising."""
        child = Child(launcher)
        self._children.append(child)
        if self._started and not self._stopping:
            self._start_child(child)

    async def remove(self, backend_id: str) -> None:
        """Stop one backend's process and stop supervising it (drained first by gateway/control/fleet.py)."""
        child = next((c for c in self._children if c.backend_id == backend_id), None)
        if child is not None:
            self._children.remove(child)
            await self._stop_child(child)

    def _set(self, child: Child, state: Lifecycle) -> None:
        child.state = state
        self._on_state(child.backend_id, state)

    async def _keep_running(self, child: Child, adopted: Process | None) -> None:
        backoff = self._backoff[0]
        while not self._stopping:
            started = self._clock.now()
            if adopted is not None:   # already running and ready: follow it until it exits
                child.process, adopted = adopted, None
                self._on_spawn(child.backend_id, child.process.pid)
                code, reason = await child.process.wait(), None
            else:
                code, reason = await self._launch(child, started)
            if self._stopping:
                return
            if self._clock.now() - started >= self._stable_after_s:
                backoff = self._backoff[0]
            child.last_exit = reason or exit_reason(code)
            self._on_exit(child.backend_id, child.last_exit)
            self._set(child, "restarting")
            log.warning("engine_exited", backend=child.backend_id, code=code, reason=child.last_exit,
                        restart_in_s=backoff)
            await self._clock.sleep(backoff)
            backoff = min(self._backoff[1], backoff * 2)
            child.restarts += 1

    async def _launch(self, child: Child, started: float) -> tuple[int, str | None]:
        """Launch the backend and wait until it exits, or stop it if it is not ready in time; its exit code,
        and why in words where the code does not say (the start timeout)."""
        plan = child.launcher.plan()
        self._set(child, "starting")
        self._on_launch(child.backend_id)
        process = child.process = await self._spawner.spawn(plan.argv, plan.env, outlive_parent=plan.outlive_parent)
        child.outlives = plan.outlive_parent
        self._on_spawn(child.backend_id, process.pid)
        # the process guard's pid (its engine's own is the one /admin/backends shows, once it reports it)
        log.info("engine_launched", backend=child.backend_id, guard_pid=process.pid, restarts=child.restarts)
        if await self._wait_ready(child, process, started):
            self._set(child, "ready")
            log.info("engine_ready", backend=child.backend_id, guard_pid=process.pid,
                     start_s=round(self._clock.now() - started, 3))
            return await process.wait(), None
        if process.returncode is None:
            timeout_s = child.launcher.start_timeout_s
            log.error("engine_start_timeout", backend=child.backend_id, guard_pid=process.pid, timeout_s=timeout_s)
            return await self._stop_process(process), f"not ready within its start timeout ({timeout_s:g} s): stopped"
        return process.returncode, None

    async def _wait_ready(self, child: Child, process: Process, started: float) -> bool:
        """Poll the launcher's readiness until it says yes, the process exits, or the start timeout."""
        launcher = child.launcher
        deadline = started + launcher.start_timeout_s
        while process.returncode is None:
            if await launcher.ready():
                return process.returncode is None
            if self._clock.now() >= deadline:
                return False
            await self._clock.sleep(launcher.probe_interval_s)
        return False

    async def _stop_process(self, process: Process) -> int:
        """SIGTERM (the guard stops the engine's group), SIGKILL if it outlives the stop timeout."""
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            return await asyncio.wait_for(process.wait(), self._stop_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            return await process.wait()

    async def _stop_child(self, child: Child) -> None:
        if child.task is not None:
            child.task.cancel()
        if child.process is not None and child.process.returncode is None:
            await self._stop_process(child.process)
        if child.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await child.task
        self._set(child, "stopped")

    async def stop(self) -> None:
        """Stop every managed process and wait for all of them."""
        self._stopping = True
        await asyncio.gather(*(self._stop_child(c) for c in self._children))

    async def leave(self) -> None:
        """Stop supervising, leaving running the processes that outlive this gateway (`kind: engine`
        guards with replicas: they serve on, for the replica that adopts them; gateway/replicas/
        leadership.py); the others (a `kind: openai` command) are stopped as `stop` does."""
        self._stopping = True
        leaving = [c.task for c in self._children if c.outlives and c.task is not None]
        for task in leaving:
            task.cancel()
        await asyncio.gather(*leaving, *(self._stop_child(c) for c in self._children if not c.outlives),
                             return_exceptions=True)
