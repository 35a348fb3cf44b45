"""A replica's own checks of the backends it last heard of through Redis, while Redis is away.

With Redis away a replica hears only the heartbeats that reach its own control port; of the other
backends it knows the last state Redis gave it. Past `fail_open_hold_s` that state alone is no reason
to route there any more, but the replica can still find out whether the backend is up by asking it
directly (shared_state.py keeps the backends that answer as candidates):

- `kind: engine`: one gRPC `grpc.health.v1.Health/Check` on the address the requests go to, on a
  channel of its own, bounded by `held_check_timeout_s`. The engines serve no health service, so the
  answer they give is UNIMPLEMENTED: a gRPC server listening there that answered an RPC, which is
  what a request needs (a server that does serve health must say SERVING). Refused, unresolvable or
  silent past the timeout: no answer.
- `kind: openai`: the gateway's own probe of the upstream (gateway/control/upstream_monitor.py)
  already runs on every replica; its verdict (`StateTable.reachable`) is taken, no second call made.

Rate: one check at a time per backend, at most one every `held_check_interval_s`; a backend is found
unreachable after `held_check_failures` checks in a row without an answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routing.state_table import StateTable

log = structlog.get_logger("shared_state")

# (address, timeout in seconds) -> whether a server there answered within it
Probe = Callable[[str, float], Awaitable[bool]]
# Beyond a check's own deadline: the time its channel may take to set up and close.
CHANNEL_MARGIN_S = 0.1


async def engine_answers(address: str, timeout_s: float) -> bool:
    """A gRPC server at `address` answered a health check within `timeout_s`: SERVING, or UNIMPLEMENTED
    (a server without the health service, as the engines are). A fresh channel each time, so that a
    restarted engine is not hidden behind the reconnect backoff of a channel that saw it die."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return bool(exc.code() == grpc.StatusCode.UNIMPLEMENTED)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class _Check:
    due: float = 0.0          # the next check not before (table clock)
    failures: int = 0         # checks in a row without an answer
    answered: bool = False    # some check of this outage got one
    task: asyncio.Task[None] | None = None


class DirectChecks:
    """The checks of one outage: `tick` starts those due, `answered` / `unreachable` give the verdicts."""

    def __init__(self, table: StateTable, interval_s: float, timeout_s: float, failures: int,
                 probe: Probe = engine_answers) -> None:
        self._table = table
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failures = failures
        self._probe = probe
        self._checks: dict[str, _Check] = {}

    def restart(self) -> None:
        """A new outage: nothing known yet (checks of the last one still out are dropped)."""
        self.cancel()
        self._checks = {}

    def tick(self, backend_ids: Iterable[str]) -> None:
        """Start the checks that are due (kind: engine backends only: the others have their probe)."""
        now = self._table.clock()
        for backend_id in backend_ids:
            entry = self._table.get(backend_id)
            if entry is None or entry.external:
                continue
            check = self._checks.setdefault(backend_id, _Check())
            if check.task is None and now >= check.due:
                check.due = now + self._interval_s
                check.task = asyncio.create_task(self._run(check, entry.address or ""))

    async def _run(self, check: _Check, address: str) -> None:
        try:   # the probe bounds itself; this bounds the channel's set-up and close too
            answered = bool(address) and await asyncio.wait_for(self._probe(address, self._timeout_s),
                                                                self._timeout_s + CHANNEL_MARGIN_S)
        except Exception as exc:   # timed out, or a channel that could not even be made: no answer
            answered = False
            if not isinstance(exc, TimeoutError):
                log.warning("held_check_error", address=address, error=repr(exc))
        finally:
            check.task = None
        check.answered = check.answered or answered
        check.failures = 0 if answered else check.failures + 1

    def answered(self, backend_id: str) -> bool:
        """A check of this outage got an answer, and it has not stopped answering since (`unreachable`
        says when it has): one slow check on a loaded host does not drop a backend that answers the next
        (kind: openai: the upstream probe's last verdict)."""
        entry = self._table.get(backend_id)
        if entry is not None and entry.external:
            return self._table.reachable(backend_id) is True
        check = self._checks.get(backend_id)
        return check is not None and check.answered

    def unreachable(self, backend_id: str) -> bool:
        """It stopped answering: `failures` checks in a row without an answer (kind: openai: the upstream
        probe found it unreachable)."""
        entry = self._table.get(backend_id)
        if entry is None:
            return True
        if entry.external:
            return self._table.reachable(backend_id) is False
        check = self._checks.get(backend_id)
        return check is not None and check.failures >= self._failures

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel the checks still out; returns them (to be awaited at shutdown)."""
        tasks = [c.task for c in self._checks.values() if c.task is not None]
        for task in tasks:
            task.cancel()
        return tasks

    async def close(self) -> None:
        await asyncio.gather(*self.cancel(), return_exceptions=True)
