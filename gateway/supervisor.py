"""Launches the managed engines of backends.yaml, restarts them when they die, stops them all on exit.

Each managed entry becomes `python -m backends.engine ...` pointed at the gateway's control port.
A child that exits is restarted after a backoff that doubles from `backoff_min_s` to
`backoff_max_s` and resets once a child has stayed up for `stable_after_s`. Engines also exit by
themselves when the gateway process disappears (they watch their parent), so a SIGKILLed gateway
leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field

import structlog

from gateway.config import BackendSpec, ClusterConfig

log = structlog.get_logger("supervisor")


@dataclass
class Child:
    spec: BackendSpec
    argv: list[str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Supervisor:
    def __init__(
        self,
        config: ClusterConfig,
        control_address: str,
        *,
        log_level: str = "warning",
        backoff_min_s: float = 0.25,
        backoff_max_s: float = 10.0,
        stable_after_s: float = 30.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self._children = [
            Child(spec, engine_argv(config, spec, control_address, log_level))
            for spec in config.raw.backends
            if spec.launch is not None
        ]
        self._backoff = (backoff_min_s, backoff_max_s)
        self._stable_after_s = stable_after_s
        self._stop_timeout_s = stop_timeout_s
        self._stopping = False

    @property
    def children(self) -> list[Child]:
        return self._children

    def start(self) -> None:
        for child in self._children:
            child.task = asyncio.create_task(self._keep_running(child), name=f"supervise-{child.spec.id}")

    async def _keep_running(self, child: Child) -> None:
        backoff = self._backoff[0]
        while not self._stopping:
            child.process = await asyncio.create_subprocess_exec(*child.argv, stdin=asyncio.subprocess.DEVNULL)
            started = time.monotonic()
            log.info("engine_launched", backend=child.spec.id, pid=child.process.pid, restarts=child.restarts)
            code = await child.process.wait()
            if self._stopping:
                return
            if time.monotonic() - started >= self._stable_after_s:
                backoff = self._backoff[0]
            log.warning("engine_exited", backend=child.spec.id, code=code, restart_in_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(self._backoff[1], backoff * 2)
            child.restarts += 1

    async def stop(self) -> None:
        """SIGTERM every engine, SIGKILL those still alive after the timeout, and wait for all."""
        self._stopping = True
        for child in self._children:
            if child.task is not None:
                child.task.cancel()
        running = [c.process for c in self._children if c.process is not None and c.process.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), self._stop_timeout_s)
        except TimeoutError:
            for proc in running:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in running))
        for child in self._children:
            if child.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await child.task


def engine_argv(config: ClusterConfig, spec: BackendSpec, control_address: str, log_level: str) -> list[str]:
    launch = spec.launch
    assert launch is not None
    return [
        sys.executable, "-m", "backends.engine",
        "--backend-id", spec.id,
        "--role", spec.role,
        "--gpu", spec.gpu,
        "--model", config.raw.model,
        "--gateway", control_address,
        "--time-scale", str(launch.time_scale),
        "--max-batch", str(launch.max_batch),
        "--memory-utilization", str(launch.memory_utilization),
        "--heartbeat-ms", str(config.settings.heartbeat_interval_ms),
        "--vision-batch", str(launch.vision_batch),
        "--vision-batch-timeout-ms", str(launch.vision_batch_timeout_ms),
        "--steal-episode-ms", str(launch.steal_episode_ms),
        "--log-level", log_level,
        *(["--steal"] if spec.steal else []),
        *launch.extra_args,
    ]
