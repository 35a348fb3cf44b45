"""One pool of the state table (the backends of one role set) kept as columns, from which every
decision's `Candidates` are cut.

Walking every backend in Python per decision (health, exclusions, snapshot) costs about a
microsecond a backend; here health and exclusions are array operations, and the snapshots and their
columns are patched only in the rows whose signals changed since the last read. Patches copy
(copy-on-write), so `Candidates` already handed out stay exactly as they were given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from gateway.routing.backend_entry import BackendEntry
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot

_NEVER = float("-inf")   # no heartbeat yet: now - _NEVER is never within the limit
_INF = float("inf")


class CandidateColumns:
    def __init__(
        self, entries: Sequence[BackendEntry], snapshot: Callable[[BackendEntry], BackendSnapshot],
        serves: Callable[[BackendEntry], bool],
    ) -> None:
        self._entries = list(entries)
        self._snapshot = snapshot
        self._serves = serves   # False: never a candidate, fresh or stale
        # Each row's serving flag and heartbeat twice: as arrays for the whole-pool operations, and as
        # lists for the per-row reads of `_note` (a numpy element read and compare is a few times slower).
        self._serving = np.ones(len(self._entries), dtype=bool)
        self._serving_rows = [True] * len(self._entries)
        self._heartbeat = np.full(len(self._entries), _NEVER)
        self._heartbeat_rows = [_NEVER] * len(self._entries)
        self._rows = {e.id: k for k, e in enumerate(self._entries)}
        self._oldest: float | None = None   # min(self._heartbeat), None when to be recomputed
        self._newest = _NEVER               # max(self._heartbeat), recomputed with _oldest
        self._unheard: tuple[BackendEntry, ...] | None = None   # external serving rows; None: recompute
        self._none = Candidates(())
        self._external = np.array([e.external for e in self._entries], dtype=bool)
        self._has_external = bool(self._external.any())
        self._waiting = [0] * len(self._entries)
        self._backlog = 0
        self._snapshots = [snapshot(e) for e in self._entries]
        self._all = Candidates(self._snapshots)
        for k, e in enumerate(self._entries):
            self._note(k, e)
        self._changed: set[int] = set()      # rows whose entries changed, not yet noted
        self._stale_rows: set[int] = set()   # rows noted, their snapshots and columns not yet rebuilt

    def changed(self, backend_ids: Iterable[str]) -> None:
        """These backends' snapshots were dropped: re-read their rows before the next selection."""
        rows, changed = self._rows, self._changed
        for i in backend_ids:   # mostly one or two: a loop costs less than a generator
            if (k := rows.get(i)) is not None:
                changed.add(k)

    def select(self, now: float, limit_s: float, exclude: Iterable[str], late_s: float = 0.0) -> (
        tuple[Candidates, Sequence[BackendEntry]]
    ):
        """The backends heard from within `limit_s`, and the external ones that were not, less `exclude`.
        When none was heard from within `limit_s`, those heard from within `late_s` are returned with the
        external ones (the caller fails open on them), in registration order."""
        if self._changed:
            self._flush()
        skip = [self._rows[i] for i in exclude if i in self._rows] if exclude else []
        if self._oldest is None:
            self._oldest = float(self._heartbeat.min()) if self._entries else _INF
            self._newest = float(self._heartbeat.max()) if self._entries else _NEVER
        if not skip:
            if now - self._oldest <= limit_s:   # the oldest heartbeat is fresh, so all are
                return self._current(), ()
            if now - self._newest > limit_s:    # none is: external backends without metrics, mostly
                if now - self._newest <= late_s:
                    return self._none, self._late(now, late_s, skip)
                if self._unheard is None:
                    self._unheard = tuple(e for k, e in enumerate(self._entries)
                                          if self._external[k] and self._serving[k])
                return self._none, self._unheard
        fresh = (now - self._heartbeat) <= limit_s
        if skip:
            fresh[skip] = False
        if not fresh.any() and now - self._newest <= late_s:
            return self._none, self._late(now, late_s, skip)
        stale: list[BackendEntry] = []
        if self._has_external:
            unheard = self._external & self._serving & ~fresh
            unheard[skip] = False
            stale = [self._entries[k] for k in unheard.nonzero()[0].tolist()]
        if fresh.all():
            return self._current(), stale
        return self._current().take(fresh.nonzero()[0]), stale

    def _late(self, now: float, late_s: float, skip: list[int]) -> list[BackendEntry]:
        """The serving rows heard from within `late_s` and the external serving ones, less `skip`: what a
        pool none of whose backends is fresh fails open on (only then: a rare path)."""
        rows = self._serving & (self._external | ((now - self._heartbeat) <= late_s))
        rows[skip] = False
        return [self._entries[k] for k in rows.nonzero()[0].tolist()]

    def backlog(self) -> int:
        """Requests waiting in this pool's engines, as last reported (healthy or not)."""
        if self._changed:
            self._flush()
        return self._backlog

    def _note(self, k: int, e: BackendEntry) -> None:
        serving = self._serves(e)
        if serving != self._serving_rows[k]:
            self._serving[k] = self._serving_rows[k] = serving
            self._unheard = None
        heartbeat = _NEVER if e.last_heartbeat is None or not serving else e.last_heartbeat + e.grace_s
        old = self._heartbeat_rows[k]
        if heartbeat != old:
            self._heartbeat[k] = self._heartbeat_rows[k] = heartbeat
            # A heartbeat moving forward in a row that was not the oldest leaves the oldest as it was
            # (the usual case: one row changes per heartbeat); anything else recomputes both ends.
            if self._oldest is not None and self._oldest < old <= heartbeat:
                self._newest = max(self._newest, heartbeat)
            else:
                self._oldest = None
        self._backlog += e.reported.waiting - self._waiting[k]
        self._waiting[k] = e.reported.waiting

    def _flush(self) -> None:
        """Note the changed rows' signals now; rebuild their snapshots and columns only when read
        (`_current`): a pool that fails open never reads them."""
        for k in self._changed:
            self._note(k, self._entries[k])
        self._stale_rows |= self._changed
        self._changed = set()

    def _current(self) -> Candidates:
        """Every row, as candidates, the changed rows' snapshots and columns rebuilt (copy-on-write)."""
        if self._stale_rows:
            entries, snapshot = self._entries, self._snapshot
            self._all = self._all.replaced([(k, snapshot(entries[k])) for k in self._stale_rows], self._snapshots)
            self._stale_rows.clear()
        return self._all
