"""Per-backend circuit breakers: a small state machine with an injected clock.

    closed ──(failure_threshold consecutive failures)──▶ open ──(open_s elapsed)──▶ half-open
    half-open ──(the one probe succeeds)──▶ closed;  ──(it fails)──▶ open again

Only backend faults count (connection errors, the backend's own timeouts, engine errors); what the
client does never does: its bad request, its own deadline passing, its disconnect. The pipeline
decides which is which (`Pipeline.backend_fault`). While open, the backend is not a routing
candidate; in half-open exactly one request is let through as the probe, and a probe that ends for
the client's reasons (`on_abandon`) proves nothing either way: the next request probes instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from gateway.config.sections import BreakerConfig


class State(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class _Breaker:
    state: State = State.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False


class Breakers:
    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._breakers: dict[str, _Breaker] = {}

    def state(self, backend_id: str) -> State:
        b = self._breakers.get(backend_id)
        if b is None:
            return State.CLOSED
        if b.state is State.OPEN and self._clock() - b.opened_at >= self.config.open_s:
            b.state, b.probing = State.HALF_OPEN, False
        return b.state

    def blocked(self) -> list[str]:
        """Backends that must not get a request now (open, or half-open with its probe out)."""
        return [bid for bid, b in self._breakers.items() if self.state(bid) is State.OPEN or b.probing]

    def on_dispatch(self, backend_id: str) -> None:
        b = self._breakers.get(backend_id)
        if b is not None and self.state(backend_id) is State.HALF_OPEN:
            b.probing = True

    def on_success(self, backend_id: str) -> None:
        b = self._breakers.get(backend_id)
        if b is not None:
            b.state, b.failures, b.probing = State.CLOSED, 0, False

    def on_abandon(self, backend_id: str) -> None:
        """A dispatch ended before the backend answered, and not by its fault: nothing is counted, and
        a probe that was out is given back (else the backend would stay blocked)."""
        b = self._breakers.get(backend_id)
        if b is not None:
            b.probing = False

    def on_failure(self, backend_id: str) -> None:
        b = self._breakers.setdefault(backend_id, _Breaker())
        b.failures += 1
        if b.state is State.HALF_OPEN or b.failures >= self.config.failure_threshold:
            b.state, b.opened_at, b.probing = State.OPEN, self._clock(), False
