"""The candidates of one decision: their snapshots, and the numbers policies compute on as columns.

`Candidates` is a tuple of `BackendSnapshot`s, so every policy that takes `Sequence[BackendSnapshot]`
reads it unchanged; a policy may take the fast path and compute on `columns` instead, one array
operation per term rather than one Python step per candidate. The state table hands out
`Candidates` whose columns it keeps from one decision to the next and patches only the rows whose
signals changed (`gateway/routing/candidate_columns.py`); `Candidates(snapshots)` builds them from any
sequence (the simulator, tests), reading each snapshot once.

The columns are a read-only (len(COLUMNS), N) float64 array; row k holds field COLUMNS[k] of every
candidate, in candidate order. `queue_s` is Q_i · T̄_service(i) (Eq. 3); `kv_fit_tokens` is Eq. 4's
M_free_i / KV-per-token rounded down (+inf with no KV cost per token): for an integer L_r,
L_r > M_free_i / kv ⇔ L_r > kv_fit_tokens, exact for caches below 2^53 tokens. `max_context` is
+inf where the snapshot's is 0 (unknown, no limit), as `BackendSnapshot.fits` reads it.
`speed_prefill_s_per_token` is the learned p̂ where there is one, else 2·P / F_i; `kv_capacity_tokens`
is K_i (0: unknown) and `kv_used_tokens` max(K_i − free tokens, this router's reservations), 0 where
K_i is (the inputs of `marginal_delay`); `kv_headroom_tokens` is K_i − max(0, kv_used_tokens), +inf
where K_i is not above 0: a request reserving more only there may wait for that cache or be vetoed
by it, so a decision finds those few rows with one comparison and prices them alone;
`in_flight` is every request running there, other clients' included (`BackendSnapshot.foreign_running`);
`stall_factor` and `stall_per_prompt_s` are the backend's calibrated stall (`common.calibration`);
`itl_slack_k_s` is the snapshot's k-th smallest inter-token slack, +inf where it has fewer.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from common.itl_slack import EXPOSED
from gateway.routing.policies.contracts import BackendSnapshot

FloatArray = npt.NDArray[np.float64]

COLUMNS = ("prefill_s_per_token", "queue_depth", "mean_service_s", "queue_s", "kv_fit_tokens", "max_context",
           "speed_prefill_s_per_token", "decode_step_s", "in_flight", "prefill_backlog_tokens", "kv_capacity_tokens",
           "kv_used_tokens", "kv_headroom_tokens", "stall_factor", "stall_per_prompt_s",
           *(f"itl_slack_{k}_s" for k in range(EXPOSED)))
(PREFILL, QUEUE, SERVICE, QUEUE_S, KV_FIT, MAX_CONTEXT, SPEED_PREFILL, DECODE_STEP, IN_FLIGHT, PREFILL_BACKLOG,
 KV_CAPACITY, KV_USED, KV_HEADROOM, STALL_FACTOR, STALL_PER_PROMPT) = range(len(COLUMNS) - EXPOSED)
ITL_SLACKS = slice(STALL_PER_PROMPT + 1, STALL_PER_PROMPT + 1 + EXPOSED)   # the rows of itl_slack_s, +inf past its end
_INF = float("inf")
_NO_SLACK = (_INF,) * EXPOSED
# The policies compute on columns as Python computes on floats: 0 · inf is NaN, an overflow inf, x / 0 inf or
# NaN, all silently (the scalar forms of the same costs never warn). One filter for the policy modules, set
# here once, instead of np.errstate around every decision: entering and leaving it cost 1.5-3 µs a call.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"gateway\.routing\.policies\.")
# Up to this many candidates a policy loops over them: each numpy operation costs ~1 µs however small
# its arrays, and a few candidates' columns then need not be built at all.
LOOP_UP_TO = 8


def column_values(b: BackendSnapshot) -> tuple[float, ...]:
    """One candidate's column entries, in COLUMNS order (the one place they are derived)."""
    free, per_token, queue, service = b.kv_free_bytes, b.kv_bytes_per_token, b.queue_depth, b.mean_service_s
    fit = free // per_token if per_token else (_INF if free >= 0 else -_INF)
    capacity = b.kv_total_bytes // per_token if per_token else 0
    used = max(capacity - free // per_token, b.kv_reserved_tokens) if capacity else 0
    return (b.prefill_s_per_token, queue, service, queue * service, fit, b.max_context or _INF,
            b.learned_prefill_s_per_token or b.prefill_s_per_token, b.decode_step_s, b.in_flight + b.foreign_running,
            b.prefill_backlog_tokens, capacity, used, capacity - max(0, used) if capacity > 0 else _INF,
            b.stall_factor, b.stall_per_prompt_s, *(b.itl_slack_s + _NO_SLACK)[:EXPOSED])


def first_argmin(totals: FloatArray) -> int:
    """The first candidate with the lowest cost below infinity, else the first: what a loop keeping
    the first strictly lower total finds (argmin alone would stop at a NaN)."""
    return _first_argmin(totals)[0]


def _first_argmin(totals: FloatArray) -> tuple[int, float]:
    """`first_argmin` and its total, read once (a numpy element read costs as much as the compare)."""
    i = int(totals.argmin())
    best = totals.item(i)
    if best < _INF:   # neither NaN (argmin stops at the first) nor inf: argmin is the loop's answer
        return i, best
    i = first_lowest(totals.tolist())
    return i, totals.item(i)


class Draw(Protocol):
    """Where a tie's draw comes from: `random.Random`, or a test's stand-in."""

    def randrange(self, stop: int, /) -> int: ...


def near_lowest(totals: Sequence[float] | FloatArray, rng: Draw, tolerance: float) -> int:
    """The candidate with the lowest total, drawn with `rng` among those within `tolerance` (relative) of
    it, so that backends alike share the load instead of the first taking it all; `first_argmin`'s
    answer where the lowest is not finite or only one is that close. The loop over a list and the
    array form give the same candidates in the same order, so they draw the same."""
    if isinstance(totals, np.ndarray):
        i, best = _first_argmin(totals)
        if not abs(best) < _INF:
            return i
        near = totals <= best + tolerance * abs(best)
        count = int(np.count_nonzero(near))   # mostly the lowest alone: no draw, no list of rows
        return i if count < 2 else int(near.nonzero()[0][rng.randrange(count)])
    i = first_lowest(totals)
    best = totals[i]
    if not abs(best) < _INF:
        return i
    limit = best + tolerance * abs(best)
    ties = [k for k, t in enumerate(totals) if t <= limit]
    return i if len(ties) < 2 else ties[rng.randrange(len(ties))]


def first_lowest(totals: Iterable[float]) -> int:
    """The loop `first_argmin` answers for: the first strictly lowest total below infinity, else 0."""
    best_i, best = 0, _INF
    for k, total in enumerate(totals):
        if total < best:
            best_i, best = k, total
    return best_i


def column_array(snapshots: Iterable[BackendSnapshot]) -> FloatArray:
    rows = [column_values(b) for b in snapshots]
    if not rows:
        return np.empty((len(COLUMNS), 0))
    return np.array(rows, dtype=np.float64).T


class Candidates(tuple[BackendSnapshot, ...]):
    """Snapshots in candidate order, with `columns` (see the module docstring); immutable like them.

    The columns are built on first read: a policy that loops over a few candidates never reads them,
    and then neither the table's patches nor the candidates pay for them. So are `ids`, which the
    table's patches carry over (a patch replaces a backend's snapshot with its next one).
    """

    _columns: FloatArray | None
    _smallest_context: float | None
    _ids: tuple[str, ...] | None
    _rows: dict[str, int] | None

    def __new__(cls, snapshots: Iterable[BackendSnapshot], columns: FloatArray | None = None,
                smallest_context: float | None = None, ids: tuple[str, ...] | None = None) -> Candidates:
        """`columns`: these snapshots' columns when the caller has them (None: built on first read);
        `smallest_context`: the least of the max_context column when the caller knows it (None: worked
        out on first use); `ids`: the snapshots' ids when the caller has them."""
        self = tuple.__new__(cls, snapshots)
        if columns is not None:
            columns.setflags(write=False)
        self._columns = columns
        self._smallest_context = smallest_context
        self._ids = ids
        self._rows = None
        return self

    @property
    def ids(self) -> tuple[str, ...]:
        """The candidates' backend ids, in order."""
        if self._ids is None:
            self._ids = tuple([b.id for b in self])
        return self._ids

    @property
    def rows(self) -> dict[str, int]:
        """Each candidate's row by backend id (a per-backend figure of the request, such as its cached
        tokens, lands in its row without a walk over every candidate). Read-only by convention."""
        if self._rows is None:
            self._rows = {bid: k for k, bid in enumerate(self.ids)}
        return self._rows

    def column_of(self, values: Mapping[str, float]) -> FloatArray:
        """A per-backend figure of the request (its cached tokens on some backends, say) as a column:
        each candidate's value in its row, 0 where absent."""
        rows = self.rows
        column = np.zeros(len(self))
        for bid, value in values.items():
            if (k := rows.get(bid)) is not None:
                column[k] = value
        return column

    def left_of(self, total: int, values: Mapping[str, int]) -> FloatArray:
        """`total` less a per-backend figure of the request, as a column: total − value in the rows of the
        backends in `values`, total elsewhere (a prompt's tokens to prefill, less the prefix each backend
        holds). The float of each integer difference, as `float(total) - column_of(values)` gives below
        2^53, in one array operation fewer."""
        rows = self.rows
        column = np.empty(len(self))
        column.fill(total)
        for bid, value in values.items():
            if (k := rows.get(bid)) is not None:
                column[k] = total - value
        return column

    @property
    def columns(self) -> FloatArray:
        if self._columns is None:
            array = column_array(self)
            array.setflags(write=False)
            self._columns = array
        return self._columns

    @property
    def smallest_context(self) -> float:
        """The shortest context among the candidates (+inf: none, or no limit). Every decision asks
        whether the request fits them all: one comparison instead of two array operations."""
        if self._smallest_context is None:
            if self._columns is not None:
                self._smallest_context = float(self._columns[MAX_CONTEXT].min()) if len(self) else _INF
            else:
                self._smallest_context = float(min((b.max_context or _INF for b in self), default=_INF))
        return self._smallest_context

    @classmethod
    def of(cls, candidates: Sequence[BackendSnapshot]) -> Candidates:
        """`candidates` itself when it already carries columns, else its columns built once."""
        return candidates if isinstance(candidates, Candidates) else cls(candidates)

    def replaced(self, changes: Iterable[tuple[int, BackendSnapshot]],
                 snapshots: list[BackendSnapshot] | None = None) -> Candidates:
        """These candidates with the snapshot at some rows replaced (copy-on-write: `self` stays as it
        was): built columns are copied and patched in those rows only, the shortest context carried
        over unless a patched row's changed, the ids unless a row's backend did. `snapshots`: the
        caller's list of these candidates, updated in place and used instead of a copy."""
        snapshots = list(self) if snapshots is None else snapshots
        smallest, ids = self._smallest_context, self._ids
        columns = None if self._columns is None else self._columns.copy()
        for k, b in changes:
            old = snapshots[k]
            if b.max_context != old.max_context:   # rare (a new max_model_len): worked out again
                smallest = None
            if b.id != old.id:
                ids = None
            snapshots[k] = b
            if columns is not None:
                columns[:, k] = column_values(b)
        out = Candidates(snapshots, columns, smallest, ids)
        if ids is not None:
            out._rows = self._rows
        return out

    def take(self, rows: npt.NDArray[np.intp]) -> Candidates:
        """The candidates at `rows` (ascending), in order."""
        return Candidates([self[k] for k in rows.tolist()], self.columns[:, rows])

    def fitting(self, context_tokens: int) -> Candidates:
        """Those whose context holds `context_tokens` (prompt + max_tokens): `BackendSnapshot.fits`."""
        if context_tokens <= self.smallest_context:
            return self
        fits = self.columns[MAX_CONTEXT] >= context_tokens
        return self if fits.all() else self.take(fits.nonzero()[0])

    def extended(self, more: Sequence[BackendSnapshot]) -> Candidates:
        """These candidates followed by `more` (e.g. work stealers), built columns joined, not rebuilt."""
        if not more:
            return self
        smallest = min(self.smallest_context, float(min(b.max_context or _INF for b in more)))
        if self._columns is None:
            return Candidates((*self, *more), None, smallest)
        return Candidates((*self, *more), np.concatenate((self._columns, column_array(more)), axis=1), smallest)
