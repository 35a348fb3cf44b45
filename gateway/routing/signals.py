"""Where the backends' reports enter the gateway: one interface, an in-process store and a Redis one.

A backend's report (a heartbeat on the gRPC Control stream: queue, KV, vision backlog, counters) is
written through `SignalStore.heartbeat`, and the store's `run` keeps it in step with the other
replicas for as long as the gateway runs. The door that takes heartbeats (gateway/control/
heartbeat_service.py) does not know which store it writes to:

- `LocalSignals`, one gateway process: the report goes into this process's `StateTable`, and that is all.
- `gateway.replicas.shared_state.SharedState`, replicas sharing Redis: the report goes into the
  table too, and every refresh publishes it with this replica's own lease counts and reads the other
  replicas' reports and counts back into the table (`run`); while Redis is away it fails open on the
  table alone.

Either way the table is what routing reads; the stores differ only in where else a report goes. The
gateway's own scraper of engine metrics (gateway/control/upstream_monitor.py) writes its readings to
the table directly: every replica scrapes for itself, so they are not shared. The leases (dispatch,
first token, release) are the pipeline's, taken on the table (state_table.py); the Redis store shares
their counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from gateway.routing.backend_entry import BackendEntry, Reported
from gateway.routing.state_table import StateTable


class SignalStore(Protocol):
    table: StateTable

    def heartbeat(self, backend_id: str, seq: int, address: str, reported: Reported) -> BackendEntry | None:
        """Record one report; the backend's entry, or None for an unknown backend or an out-of-order message."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the store in step until `stop`."""
        ...


class LocalSignals:
    """The in-process store: reports go into this process's table only."""

    def __init__(self, table: StateTable,
                 on_heartbeat: Callable[[str, str], None] = lambda backend_id, address: None) -> None:
        """`on_heartbeat(backend_id, address)`: after each report taken (the gateway opens its client to
        the address a backend reports)."""
        self.table = table
        self._on_heartbeat = on_heartbeat

    def heartbeat(self, backend_id: str, seq: int, address: str, reported: Reported) -> BackendEntry | None:
        entry = self.table.apply_heartbeat(backend_id, seq, address, reported)
        if entry is not None:
            self._on_heartbeat(backend_id, address)
        return entry

    async def run(self, stop: asyncio.Event) -> None:
        """Nothing to keep in step with."""
        await stop.wait()
