"""A new leader replica takes over the engines the previous one launched, instead of relaunching them.

With replicas on one Redis, managed engines run under a process guard that outlives the gateway
that launched it (`process_guard --outlive-parent`). When that leader dies, the engines keep
heartbeating (to any replica: see the engines' control port in gateway/daemon.py) and keep serving
every replica's requests. The replica that takes the lease next adopts each one it can prove is the
engine the deployment admitted for that backend:

- the backend is healthy in this replica's table, which knows the pid its engine reports;
- that process, on this host, is `backends.engine --backend-id <id>`, and the identity in its
  environment matches the digest the replicas admit for that backend (engine_identities.py): the
  process is the one whose heartbeats the deployment accepts, not a namesake;
- its parent is a process guard, which the new leader then supervises through a pidfd (Linux):
  it sees the guard exit (and relaunches the engine then), and stops it with SIGTERM, as it stops
  the guards it launched itself.

Anything else (another host, another pid namespace, a process that does not match) is not adopted:
the new leader waits for such an engine to fall silent and launches its own, as before. An adopted
guard is not this process's child: its exit status cannot be read (`EXIT_UNKNOWN`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Collection
from pathlib import Path

import structlog

from common.control_credentials import ENV_ENGINE_IDENTITY
from gateway.routing.state_table import StateTable

log = structlog.get_logger("supervisor")

EXIT_UNKNOWN = -1   # the exit status of a process that is not our child is its parent's to read
ENGINE_MODULE = "backends.engine"
GUARD_MODULE = "gateway.control.process_guard"
Verify = Callable[[str, str], bool]   # (backend id, identity secret) -> admitted by this deployment


class AdoptedProcess:
    """A process guard another gateway launched, held through a pidfd: the `Process` the supervisor
    needs (wait, terminate, kill), with no pid-reuse race (signals go to the pidfd)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.returncode: int | None = None
        self._exited: asyncio.Future[None] | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            loop = asyncio.get_running_loop()
            if self._exited is None:
                self._exited = loop.create_future()
                loop.add_reader(self._pidfd, self._gone, loop)   # a pidfd reads ready once the process exits
            await asyncio.shield(self._exited)
        return EXIT_UNKNOWN

    def _gone(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = EXIT_UNKNOWN
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)

    def _signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        """Let go of a process that is not going to be supervised after all."""
        if self.returncode is None and self._exited is None:
            os.close(self._pidfd)
            self.returncode = EXIT_UNKNOWN


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _identity(pid: int) -> str:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = item.partition(b"=")
        if name.decode(errors="replace") == ENV_ENGINE_IDENTITY:
            return value.decode(errors="replace")
    return ""


def _is_engine(pid: int, backend_id: str) -> bool:
    argv = _argv(pid)
    return ENGINE_MODULE in argv and "--backend-id" in argv[:-1] and argv[argv.index("--backend-id") + 1] == backend_id


def adopt_engine(engine_pid: int, backend_id: str, verify: Verify) -> AdoptedProcess | None:
    """The guard of the engine `engine_pid`, if that process is this deployment's engine for
    `backend_id` under a process guard on this host; None otherwise (or without pidfds)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        if not _is_engine(engine_pid, backend_id) or not verify(backend_id, _identity(engine_pid)):
            return None
        guard = _parent(engine_pid)
        pidfd = os.pidfd_open(guard)
    except (OSError, ValueError, IndexError):   # gone, not ours to read, or not a process at all
        return None
    adopted = AdoptedProcess(guard, pidfd)
    try:   # checked again with the pidfd held: the pids named the same processes throughout
        if GUARD_MODULE in _argv(guard) and _parent(engine_pid) == guard and _is_engine(engine_pid, backend_id):
            return adopted
    except (OSError, ValueError, IndexError):
        pass
    adopted.close()
    return None


def find_adoptable(table: StateTable, backend_ids: Collection[str], verify: Verify) -> dict[str, AdoptedProcess]:
    """backend id -> the running engine's guard, for every backend in `backend_ids` whose engine can
    be adopted now (healthy, reporting its pid, proven as `adopt_engine` says)."""
    out: dict[str, AdoptedProcess] = {}
    for backend_id in backend_ids:
        entry = table.get(backend_id)
        if entry is None or not entry.reported.pid or not table.is_healthy(entry):
            continue
        adopted = adopt_engine(entry.reported.pid, backend_id, verify)
        if adopted is not None:
            log.info("engine_adopted", backend=backend_id, engine_pid=entry.reported.pid, guard_pid=adopted.pid)
            out[backend_id] = adopted
    return out
