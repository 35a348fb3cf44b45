"""The live table of backends: written by heartbeats and by the request pipeline, read by policies.

Signals have one producer each: heartbeats write what the engine reports; the pipeline writes the
gateway's own in-flight counts (the paper's feedback loop) and measured service times. Policies only
read immutable `BackendSnapshot`s, rebuilt by the pure builder of snapshots.py when a signal changes (a
producer drops `entry.snapshot`); each pool of backends is also kept as columns (`CandidateColumns`) patched in
the changed rows only, so that assembling a decision's candidates is array work, not a Python walk.

Q_i (queue_depth) = max(in-flight from this gateway, engine-reported waiting + running): the
gateway's count moves the instant a request is dispatched, the heartbeat corrects it with what the
engine really holds (including work from other gateway replicas). With replicas sharing state
(gateway/replicas/shared_state.py) the gateway's count is this replica's live count + the other replicas'
counts as of the last refresh.

Freshness: a backend is heard from when it heartbeated within the miss limit. A heartbeat carrying the
stale-metrics marker (queue depth SATURATED_QUEUE: the agent's and the gateway's scraper's way of
saying their last good scrape is too old) is not news of load: the backend stops being heard from at
once. A kind: openai backend heard from or not stays a candidate while its upstream answers the
gateway's probe (`set_reachable`); once the probe finds it unreachable it is no candidate at all, so
requests fail at once instead of waiting on it. Readiness (`servable`) counts only the backends that
can serve now: heard from, or an upstream that answers; not the ones kept as candidates only to fail
open on.

Limits, first found (`context_source`, `kv_capacity_source` in /admin/backends):
    context      the engine's max_model_len (heartbeat) · the entry's `max_model_len` · the catalog model;
                 per model for a backend serving several: the engine's figure is its first model's
                 (the one whose /v1/models entry it reports); the others' are the entry's
                 `max_model_len` where set, else their catalog model's
    KV capacity  the engine's (heartbeat) · configured (agent flag, or the entry's `kv_capacity_tokens`)
                 · the performance-model estimate

Each dispatch holds a `Lease` from `acquire` to `release`; its first token and its end feed the
backend's learned speed (`common.speed_estimator`): prefill rate, decode step and T̄_service, and its
calibrated first-token and decode-time models (`common.calibration`, fitted on the features the lease
took at dispatch and the stalls its decode saw).
Each lease also holds an inter-token deadline (`common.itl_slack`, against
`routing.itl_target_ms`): snapshots carry the smallest slacks of the requests in flight there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.itl_slack import DEFAULT_TARGET_S, InterTokenSlack
from common.metric_tables import SATURATED_QUEUE
from common.speed_estimator import prior_speed
from gateway.routing.backend_entry import (
    BackendEntry,
    Lease,
    Lifecycle,
    PeerLoad,
    Reported,
    serves,
)
from gateway.routing.candidate_columns import CandidateColumns
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Role
from gateway.routing.policies.first_token import first_token_features
from gateway.routing.snapshots import FixedFigures, build_snapshot, fixed_figures

# How far below the last seq a report that came on no Control stream is still a reordered message, and
# dropped (StateTable.apply_heartbeat). Such reports (another replica's, read back through Redis) are at
# most a refresh or two behind: a sender coalesces pokes for 5 ms, so a refresh (at most 1 s) holds at
# most 200 of its messages. Further below is a new count, taken.
REORDER_WINDOW = 256
# The moving mean of the tokens this gateway's requests prefill, by which a request another client left
# waiting in an engine is priced (BackendEntry.foreign_backlog_tokens): about the last 50 requests'.
MEAN_PREFILL_GAIN = 0.02


def _open_to(entry: BackendEntry, priority: int) -> bool:
    """Takes requests of tenants of the `priority` class (not kept for higher ones, `min_priority`)."""
    return entry.min_priority is None or priority >= entry.min_priority


def _serves_model(entry: BackendEntry, model: str | None) -> bool:
    """Whether the entry is in `model`'s pool (None: every pool; an entry that names no model serves the
    table's only one)."""
    return model is None or not entry.models or model in entry.models


class StateTable:
    def __init__(
        self,
        model: ModelProfile,
        heartbeat_interval_s: float,
        miss_limit: int = 3,
        clock: Callable[[], float] = time.monotonic,
        itl_target_s: float = DEFAULT_TARGET_S,
        fail_open_s: float = 0.0,
    ) -> None:
        """`fail_open_s`: a pool none of whose backends was heard from within the miss limit routes on
        those heard from within this many seconds (0: only on kind: openai upstreams), see `candidates`."""
        self.model = model
        self.itl_target_s = itl_target_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.miss_limit = miss_limit
        self.fail_open_s = fail_open_s
        self.clock = clock
        self._entries: dict[str, BackendEntry] = {}
        self._roles: set[Role] = set()   # of the backends registered
        self._fixed: dict[str, FixedFigures] = {}   # per backend, what its snapshots take from its registration
        # per backend serving several models: the catalog context of each beyond its first
        self._other_contexts: dict[str, dict[str, int]] = {}
        # per (backend, model) of those: (its snapshot, that snapshot with the model's context), so that a
        # model's pool hands out the same object while the snapshot stays the same
        self._model_snapshots: dict[tuple[str, str, bool], tuple[BackendSnapshot, BackendSnapshot]] = {}
        self._changes: set[str] = set()
        # per (roles, model): a model's pool is the backends that serve it (None: every backend)
        self._pools: dict[tuple[tuple[Role, ...], str | None], CandidateColumns] = {}
        # per model; emptied by a registration or a new max_model_len
        self._largest_context: dict[str | None, int] = {}
        self._failing_open: dict[str | None, bool] = {}   # per model pool, as its last language decision found
        self._reachable: dict[str, bool] = {}   # kind: openai: whether its upstream answers the probe (absent: unknown)
        self._open: dict[tuple[tuple[Role, ...], str | None], tuple[Sequence[BackendEntry], Candidates]] = {}
        self._draining: set[str] = set()   # no new requests (gateway/control/fleet.py); their leases finish
        self._cut: set[str] = set()        # drains that ran out of time: what was still under way there is cut
        self._reserved: dict[str, int] = {}   # backends kept for a priority class and above: their min_priority
        # per model, where its backends are of both kinds: its engines (kind: engine), which honour fewer of
        # a request's fields than its kind: openai backends (`engines_beside_upstreams`)
        self._mixed: dict[str | None, tuple[str, ...]] = {}
        self._stream: object | None = None   # the Control stream of the heartbeat being applied (`reporting_on`)
        self._owners: dict[str, object] = {}   # per backend, the Control stream whose report is current
        self._mean_prefill_tokens = 0.0   # of this gateway's requests, a moving mean (a foreign request's guess)
        self._prefills = 0

    # -- producers ---------------------------------------------------------------------------

    def register(
        self, backend_id: str, role: Role, gpu: GpuProfile, *, address: str | None, managed: bool,
        steal: bool = False, external: bool = False, max_model_len: int | None = None,
        kv_capacity_tokens: int | None = None, models: Iterable[str] = (), profile: ModelProfile | None = None,
        report_interval_s: float | None = None, min_priority: int | None = None,
        other_contexts: Mapping[str, int] | None = None,
    ) -> BackendEntry:
        """`models`: the names of the models it serves (none: the cluster serves one model); `profile`:
        the catalog model its figures come from (default: the table's), its first; `other_contexts`: the
        catalog context of each model it serves beyond that one (a `kind: openai` upstream serving
        several); `report_interval_s`: how often
        its reports come when that is less often than heartbeats (a scrape interval): it is heard from
        for the miss limit of its own interval; `min_priority`: kept for requests of that priority class
        or higher (`closed_to`)."""
        profile = profile or self.model
        entry = BackendEntry(backend_id, role, gpu, address, managed, prior_speed(profile, gpu),
                             InterTokenSlack(self.itl_target_s), steal, external, max_model_len=max_model_len,
                             kv_capacity_tokens=kv_capacity_tokens, models=frozenset(models), changes=self._changes,
                             min_priority=min_priority)
        self._reserved.pop(backend_id, None)
        self._owners.pop(backend_id, None)
        self._cut.discard(backend_id)
        if min_priority is not None:
            self._reserved[backend_id] = min_priority
        if report_interval_s is not None:
            entry.grace_s = self.miss_limit * max(0.0, report_interval_s - self.heartbeat_interval_s)
        self._entries[backend_id] = entry
        self._roles.add(role)
        self._fixed[backend_id] = fixed_figures(backend_id, role, gpu, profile, self._unreported_kv(entry, profile))
        self._other_contexts.pop(backend_id, None)
        if other_contexts:
            self._other_contexts[backend_id] = dict(other_contexts)
        self._model_snapshots.clear()
        self._pools.clear()
        self._open.clear()
        self._largest_context.clear()
        self._mixed.clear()
        return entry

    def unregister(self, backend_id: str) -> None:
        """The backend leaves the fleet (gateway/control/fleet.py removes it once drained: no lease is left)."""
        entry = self._entries.pop(backend_id)
        del self._fixed[backend_id]
        self._other_contexts.pop(backend_id, None)
        self._model_snapshots.clear()
        self._draining.discard(backend_id)
        self._reserved.pop(backend_id, None)
        self._reachable.pop(backend_id, None)
        self._owners.pop(backend_id, None)
        self._changes.discard(backend_id)
        self._roles = {e.role for e in self._entries.values()}
        self._pools.clear()
        self._open.clear()
        self._largest_context.clear()
        self._mixed.clear()
        entry.changes = None

    def drain(self, backend_id: str) -> None:
        """No new request goes to the backend; those it holds finish (it stays healthy for them)."""
        if backend_id not in self._entries:
            raise KeyError(backend_id)
        self._draining.add(backend_id)

    def is_draining(self, backend_id: str) -> bool:
        return backend_id in self._draining

    def cut(self, backend_id: str) -> None:
        """The backend's drain ran out of time: the requests still under way there are ended with it (kept
        past its removal, until an entry of that id is registered again)."""
        self._cut.add(backend_id)

    def was_cut(self, backend_id: str) -> bool:
        return backend_id in self._cut

    @contextlib.contextmanager
    def reporting_on(self, stream: object) -> Iterator[None]:
        """The heartbeats applied inside came on the Control stream `stream` (a value of its own, equal to
        no other stream's): see `apply_heartbeat`."""
        self._stream = stream
        try:
            yield
        finally:
            self._stream = None

    def apply_heartbeat(
        self, backend_id: str, seq: int, address: str, reported: Reported, at: float | None = None
    ) -> BackendEntry | None:
        """Record one heartbeat (received at `at`, default now); None for an unknown backend or an
        out-of-order message.

        Sequence numbers order the messages of one sender (engines start theirs at their start time
        in µs and count up by one a message), to drop a stale or reordered one. No single message may
        wedge a backend, though: one with the engine's pid and address and the largest seq would
        otherwise make every later message of the engine look stale until it restarts. So:

        - On the control port the sender is the Control stream (`reporting_on`): a stream's messages
          must count up, and one on another stream than the stream whose report is current is taken
          whatever its seq (its sender counts anew) and makes that stream current. gRPC keeps a
          stream's messages in order, so nothing is lost: an impostor's message displaces one report,
          and the engine's next message, on its own stream, takes its backend back.
        - A report that came on no stream (another replica's, through Redis; the gateway's own
          scraper's) is ordered against the last one of the same pid and address: dropped at or
          within REORDER_WINDOW below it (read again, or reordered between replicas), taken further
          below (a new count, or one after a bogus seq).
        A message from another sender (another pid or address) is always taken: a backend whose
        heartbeats were taken over by some other process recovers as soon as its own engine heartbeats
        again.
        """
        entry = self._entries.get(backend_id)
        if entry is None:
            return None
        last, stream = entry.reported.seq, self._stream
        if stream is not None:
            stale = stream == self._owners.get(backend_id) and seq <= last
        else:
            same_sender = reported.pid == entry.reported.pid and (not address or address == entry.address)
            stale = same_sender and last - REORDER_WINDOW <= seq <= last
        if stale:
            return None
        if stream is None:
            self._owners.pop(backend_id, None)
        else:
            self._owners[backend_id] = stream
        if reported.max_model_len != entry.reported.max_model_len:
            self._largest_context.clear()
        entry.reported = reported
        entry.address = address or entry.address
        entry.own_at_report = entry.engine_requests
        self._note_foreign(entry, reported=True)
        # the stale-metrics marker: no fresh load figure, so the backend is not heard from any more
        entry.last_heartbeat = None if reported.waiting >= SATURATED_QUEUE else self.clock() if at is None else at
        entry.snapshot = None
        return entry

    def _note_foreign(self, entry: BackendEntry, reported: bool) -> None:
        """The requests the engine counts (waiting + running) beyond this gateway's own engine requests at
        its report and the other replicas' in flight there are other clients': the smaller count of its
        last two reports (`reported`: a new one; else the other replicas' counts changed). Those waiting
        (at most its reported waiting) are a prefill backlog this gateway did not send, priced at the mean
        prompt its own requests prefill (their own lengths are in no engine metric); the rest run there,
        stalled by a prefill as the gateway's own are (n_i). None while the gateway's own requests account
        for the engine's count, as where it is the only client."""
        r = entry.reported
        stale = r.waiting >= SATURATED_QUEUE   # the stale marker: no load figures
        count = 0 if stale else max(0, r.waiting + r.running - entry.own_at_report - entry.peer.in_flight)
        entry.foreign_seen = (entry.foreign_seen[1], count) if reported else (entry.foreign_seen[0], count)
        foreign = min(entry.foreign_seen)
        entry.foreign_waiting = min(0 if stale else r.waiting, foreign)
        entry.foreign_running = foreign - entry.foreign_waiting
        entry.foreign_backlog_tokens = round(entry.foreign_waiting * self._mean_prefill_tokens)

    def note_exit(self, backend_id: str, reason: str) -> None:
        """A managed engine stopped serving unasked, to be relaunched: why, in words, for the operator
        (never routed on)."""
        if (entry := self._entries.get(backend_id)) is not None:
            entry.last_exit = reason
            entry.restarts += 1
            entry.process_pid = 0

    def note_process(self, backend_id: str, pid: int) -> None:
        """The supervisor runs process `pid` for this managed backend (never routed on)."""
        if (entry := self._entries.get(backend_id)) is not None:
            entry.process_pid = pid

    def set_lifecycle(self, backend_id: str, state: Lifecycle) -> None:
        """A managed engine's state as its supervisor sees it. One that stops serving takes its queue
        with it: its last report's waiting, running and vision backlog would otherwise stay in the
        operator's view and in the autoscaler's demand until a relaunched engine reports."""
        entry = self._entries[backend_id]
        entry.lifecycle = state
        if state != "ready":
            entry.last_heartbeat = None   # a relaunched engine is healthy again only once it reports
            entry.reported = replace(entry.reported, waiting=0, running=0, vision_backlog=0)
            entry.foreign_waiting = entry.foreign_running = entry.foreign_backlog_tokens = 0
            entry.foreign_seen = (0, 0)
        entry.snapshot = None   # the pools re-read its row

    def set_reachable(self, backend_id: str, answers: bool | None) -> None:
        """What the gateway's probe of a kind: openai upstream found: it answers (True), it stopped
        answering (False: no candidate until it answers again), or nothing yet (None)."""
        if backend_id not in self._entries:   # it left the fleet while the probe was out
            return
        before = self._reachable.get(backend_id)
        if answers is None:
            self._reachable.pop(backend_id, None)
        else:
            self._reachable[backend_id] = answers
        if before is not answers:
            self._entries[backend_id].snapshot = None   # the pools re-read whether it serves

    def reachable(self, backend_id: str) -> bool | None:
        return self._reachable.get(backend_id)

    def set_peer_load(self, backend_id: str, load: PeerLoad) -> None:
        """The other replicas' requests, image tokens and leases on this backend (shared state)."""
        entry = self._entries[backend_id]
        if entry.peer != load:
            entry.peer = load
            self._note_foreign(entry, reported=False)   # their requests the last report counted are no one else's
            entry.snapshot = None

    def assume_alive(self, backend_id: str) -> None:
        """Keep a backend a candidate without a heartbeat (failing open while shared state is away)."""
        entry = self._entries[backend_id]
        entry.last_heartbeat = self.clock()
        entry.snapshot = None   # the pools re-read its heartbeat (kept, it left them once its last one aged)

    def acquire(self, backend_id: str, prompt_tokens: int = 0, max_tokens: int = 0, cached_tokens: int = 0,
                awaiting_inputs: bool = False, engine_requests: int = 1) -> Lease:
        """`cached_tokens`: of the prompt, those the backend's prefix cache is predicted to hold: only the
        rest joins its prefill backlog, its stall clock and the lease's prefill (the KV reservation is
        the whole prompt + max_tokens). `awaiting_inputs`: the engine cannot start its prefill before
        its images' embeddings come (`inputs_delivered`): until then it is in flight and holds its KV,
        but is no prefill backlog, and a stall cannot delay its tokens (its inter-token slack starts
        then). Counted at once, a burst of image requests waiting on a slow encoder
        read as seconds of prefill on an idle language engine: the overload gate turned text requests
        away with 429, and each image request's encode wait taught p̂ as its prefill (4x too slow)."""
        entry = self._entries[backend_id]
        decided = entry.cached or entry.blind   # the snapshot the decision read (none: no first-token sample)
        prefilled = prompt_tokens - cached_tokens
        self._prefills += 1   # the mean of all so far until there are enough for the moving one
        gain = max(MEAN_PREFILL_GAIN, 1 / self._prefills)
        self._mean_prefill_tokens += gain * (prefilled - self._mean_prefill_tokens)
        entry.in_flight += 1
        entry.engine_requests += engine_requests
        entry.kv_reserved_tokens += prompt_tokens + max_tokens
        lease = Lease(backend_id, prefilled, prompt_tokens + max_tokens, 0, 0.0, entry=entry, max_tokens=max_tokens,
                      engine_requests=engine_requests, awaiting_inputs=awaiting_inputs,
                      mostly_cached=2 * cached_tokens > prompt_tokens)
        if not awaiting_inputs:
            self._start_prefill(entry, lease, decided)
        entry.snapshot = None
        return lease

    def inputs_delivered(self, lease: Lease) -> None:
        """The embeddings of an `awaiting_inputs` lease reached its engine: its prefill is queued from now,
        and its first-token sample counts from now, with what is ahead of it now."""
        if not lease.awaiting_inputs:
            return
        lease.awaiting_inputs = False
        entry = self._registered(lease.entry)
        if entry is None or lease.first_token_s is not None:
            return
        self._start_prefill(entry, lease, self.snapshot(entry))
        entry.snapshot = None

    def _start_prefill(self, entry: BackendEntry, lease: Lease, seen: BackendSnapshot | None) -> None:
        """`lease`'s prompt joins the backlog and the stall clock. `seen`: the backend as the request found
        it (none: no first-token model sample).

        Tokens ahead: the other replicas' backlog too (as last shared), or p̂ would blame their prompts' wait
        on this request's own few tokens. 0 (no prefill sample) for a prompt predicted more than half
        cached: its first token is mostly what the engine spends on any request, and where the prediction
        is wrong the tokens it prefilled are not these; divided by the few predicted uncached, either made
        a hit's sample many times the backend's prefill time (an H100 learned 14x its rate over one
        conversation, and new prompts went to an idle L40S). A short shared prefix (a system prompt
        ahead of long questions) still leaves samples, or p̂ would never leave its prior there."""
        lease.first_token_features = () if seen is None else first_token_features(seen, lease.prompt_tokens,
                                                                                  lease.reserve_tokens)
        entry.prefilling += 1
        entry.prefill_backlog_tokens += lease.prompt_tokens
        lease.tokens_ahead = 0 if lease.mostly_cached else entry.prefill_backlog_tokens + \
            entry.peer.prefill_backlog_tokens + entry.foreign_backlog_tokens
        speed = entry.speed
        lease.itl_deadline = entry.slack.add(lease.prompt_tokens, lease.max_tokens, speed.prefill.value,
                                             speed.decode_floor_s, speed.stall_factor, speed.stall_per_prompt_s)
        lease.dispatched_s = self.clock()

    def first_token(self, lease: Lease) -> None:
        """The lease's first token arrived: its prompt leaves the backlog and its TTFT teaches p̂."""
        if lease.first_token_s is not None:
            return
        lease.first_token_s = now = self.clock()
        entry = self._registered(lease.entry)
        if entry is None:
            return
        if lease.awaiting_inputs:   # came before the gateway heard of the delivery: no start to time it from
            lease.awaiting_inputs = False
        else:
            self._end_prefill(entry, lease)
            entry.speed.first_token(now - lease.dispatched_s, lease.tokens_ahead, lease.first_token_features)
        lease.stall_mark = entry.slack.mark()
        entry.snapshot = None

    def release(self, lease: Lease, completion_tokens: int = 0) -> None:
        """End of one dispatch. `completion_tokens` > 0: it completed with its tokens streamed as they
        came, so its decode time teaches ŝ and T̄_service."""
        entry = self._registered(lease.entry)
        if entry is None:
            return
        entry.in_flight = max(0, entry.in_flight - 1)
        entry.engine_requests = max(0, entry.engine_requests - lease.engine_requests)
        entry.kv_reserved_tokens = max(0, entry.kv_reserved_tokens - lease.reserve_tokens)
        entry.slack.remove(lease.itl_deadline)
        lease.itl_deadline = None
        if lease.first_token_s is None:
            if not lease.awaiting_inputs:   # still waiting for its embeddings, it was no backlog
                self._end_prefill(entry, lease)
        elif completion_tokens:
            stalls = None if lease.stall_mark is None else entry.slack.stalls_since(lease.stall_mark)
            entry.speed.completed(lease.prompt_tokens, completion_tokens, self.clock() - lease.first_token_s, stalls)
        entry.snapshot = None

    def _registered(self, entry: BackendEntry | None) -> BackendEntry | None:
        """`entry` while it is the one registered under its id; None once it was removed or replaced (a
        lease or encode that ran meanwhile then counts nowhere, not on a new entry of that id)."""
        return entry if entry is not None and self._entries.get(entry.id) is entry else None

    @staticmethod
    def _end_prefill(entry: BackendEntry, lease: Lease) -> None:
        entry.prefilling = max(0, entry.prefilling - 1)
        entry.prefill_backlog_tokens = max(0, entry.prefill_backlog_tokens - lease.prompt_tokens)

    def acquire_vision(self, backend_id: str, image_tokens: int) -> BackendEntry:
        """An encode of `image_tokens` starts there; returns the entry to hand to `release_vision`."""
        entry = self._entries[backend_id]
        entry.vision_in_flight_tokens += image_tokens
        entry.snapshot = None
        return entry

    def release_vision(self, entry: BackendEntry, image_tokens: int) -> None:
        """The encode `acquire_vision` counted on `entry` ended."""
        if self._registered(entry) is None:
            return
        entry.vision_in_flight_tokens = max(0, entry.vision_in_flight_tokens - image_tokens)
        entry.snapshot = None

    # -- readers -----------------------------------------------------------------------------

    def has_role(self, roles: tuple[Role, ...]) -> bool:
        """Whether a backend with one of `roles` is registered (healthy or not)."""
        return not self._roles.isdisjoint(roles)

    def get(self, backend_id: str) -> BackendEntry | None:
        return self._entries.get(backend_id)

    def entries(self) -> Iterable[BackendEntry]:
        return self._entries.values()

    def is_healthy(self, entry: BackendEntry, now: float | None = None) -> bool:
        """Heard from within the miss limit, and not found unreachable."""
        if entry.last_heartbeat is None or not self._serves(entry):
            return False
        now = self.clock() if now is None else now
        return now - entry.last_heartbeat - entry.grace_s <= self.miss_limit * self.heartbeat_interval_s

    def servable(self, roles: tuple[Role, ...], now: float | None = None, model: str | None = None,
                 priority: int | None = None) -> int:
        """How many backends with one of `roles` (serving `model`; None: any; open to tenants of the
        `priority` class, None: any class) can serve now (readiness): heard from within the miss limit,
        or kind: openai upstreams that answer the probe though their metrics are stale or absent; not
        draining. A stale backend kept as a candidate only to fail open on, before or without an
        answer, is not counted."""
        now = self.clock() if now is None else now
        return sum(1 for e in self._entries.values() if e.role in roles and e.id not in self._draining
                   and _serves_model(e, model) and (priority is None or _open_to(e, priority)) and (
                       self.is_healthy(e, now) or self.answers_unheard(e)))

    def answers_unheard(self, entry: BackendEntry) -> bool:
        """A kind: openai upstream that answers the probe, whatever its metrics say: it serves (counted
        ready, shown `reachable` while not heard from)."""
        return entry.external and serves(entry) and self._reachable.get(entry.id) is True

    def _serves(self, entry: BackendEntry) -> bool:
        """May be routed to at all: a launched engine once ready, and not an upstream found unreachable."""
        return serves(entry) and self._reachable.get(entry.id) is not False

    def engines_beside_upstreams(self, model: str | None = None) -> tuple[str, ...]:
        """The engines (kind: engine) of `model`'s backends when some of them are kind: openai, else none: a
        request with fields only an upstream honours (tools, logprobs, n > 1, ...) is kept off them."""
        engines = self._mixed.get(model)
        if engines is None:
            members = [e for e in self._entries.values() if _serves_model(e, model)]
            engines = tuple([e.id for e in members if not e.external])
            self._mixed[model] = engines = engines if len(engines) < len(members) else ()
        return engines

    def closed_to(self, priority: int) -> tuple[str, ...]:
        """The backends kept for priority classes above `priority` (`min_priority`): none of a request of
        that class's candidates. O(reserved backends); mostly none."""
        if not self._reserved:
            return ()
        return tuple([backend_id for backend_id, least in self._reserved.items() if least > priority])

    def candidates(self, roles: tuple[Role, ...], now: float | None = None, exclude: Iterable[str] = (),
                   model: str | None = None) -> Candidates:
        """Healthy backends whose role is in `roles` and that serve `model` (None: any), as snapshots (and
        columns), in registration order; draining backends are not candidates.

        An external (kind: openai) backend whose metrics are stale stays a candidate but looks
        saturated; when every candidate is such a backend the table fails open and routes on the
        gateway's own in-flight counts (`failing_open` says so). One whose upstream does not answer
        the probe is no candidate. So, when no backend of the pool was heard from within the miss limit,
        are those heard from within `fail_open_s`: a lone engine whose heartbeats come late on a busy
        host is sent the request, which waits for it, where a 503 would lose a request it serves a
        moment later (with a fresh backend in the pool, the late ones are no candidates).
        """
        now = self.clock() if now is None else now
        if self._draining:
            exclude = self._draining.union(exclude)
        fresh, stale = self._pool(roles, model).select(now, self.miss_limit * self.heartbeat_interval_s, exclude,
                                                       self.fail_open_s)
        failing_open = bool(stale) and not fresh
        if "language" in roles:   # the flag reports on the language pool
            self._failing_open[model] = failing_open
        if failing_open:
            return self._open_candidates((roles, model), stale)
        return fresh.extended([self._saturated(e, model) for e in stale]) if stale else fresh

    @property
    def failing_open(self) -> bool:
        """Some language pool's last decision found only stale candidates and routed on the gateway's own
        in-flight counts."""
        return any(self._failing_open.values())

    def _open_candidates(self, key: tuple[tuple[Role, ...], str | None], stale: Sequence[BackendEntry]) -> (
        Candidates
    ):
        """The failing-open candidates, the same object while none of their snapshots changed, else the
        last ones patched in the rows that did (each request changes its backend's in-flight count).
        The pool hands out the same `stale` object while its members stay the same: then the rows line up."""
        members, cached = self._open.get(key, ((), None))
        model = key[1]
        if cached is not None and members is stale:
            changes = [(k, b) for k, e in enumerate(stale) if (b := self._for_model(e, model, self._blind(e)))
                       is not cached[k]]
            if changes:
                cached = cached.replaced(changes)
                self._open[key] = (stale, cached)
            return cached
        cached = Candidates([self._for_model(e, model, self._blind(e)) for e in stale])
        self._open[key] = (stale, cached)
        return cached

    def _pool(self, roles: tuple[Role, ...], model: str | None = None) -> CandidateColumns:
        if self._changes:
            for pool in self._pools.values():
                pool.changed(self._changes)
            self._changes.clear()
        key = (roles, model)
        if key not in self._pools:
            members = [e for e in self._entries.values() if e.role in roles and _serves_model(e, model)]
            snapshot: Callable[[BackendEntry], BackendSnapshot] = self.snapshot
            if model is not None and any(model in self._other_contexts.get(e.id, ()) for e in members):
                snapshot = partial(self._model_snapshot, model=model)
            self._pools[key] = CandidateColumns(members, snapshot, self._serves)
        return self._pools[key]

    def _model_snapshot(self, e: BackendEntry, model: str) -> BackendSnapshot:
        return self._for_model(e, model, self.snapshot(e))

    def _for_model(self, e: BackendEntry, model: str | None, snap: BackendSnapshot) -> BackendSnapshot:
        """`snap` (e's snapshot) as `model`'s pool reads it: with that model's context where e serves
        several models and that one's differs from its first's; the same object while `snap` is."""
        if model is None or model not in self._other_contexts.get(e.id, ()):
            return snap
        key = (e.id, model, snap is e.blind)
        kept = self._model_snapshots.get(key)
        if kept is not None and kept[0] is snap:
            return kept[1]
        context = self.context(e, model)[0]
        out = snap if context == snap.max_context else replace(snap, max_context=context)
        self._model_snapshots[key] = (snap, out)
        return out

    def _saturated(self, e: BackendEntry, model: str | None) -> BackendSnapshot:
        """A stale backend beside fresh ones, as the policies should see it: saturated in every figure one of
        them reads for a queue (depth, no free KV, a prefill backlog of SATURATED_QUEUE tokens: marginal_delay
        reads no depth, and with the backlog alone it looked idle to a short prompt)."""
        snap = self._for_model(e, model, self.snapshot(e))
        return replace(snap, queue_depth=max(SATURATED_QUEUE, e.in_flight + e.peer_in_flight), kv_free_bytes=0,
                       prefill_backlog_tokens=max(SATURATED_QUEUE, snap.prefill_backlog_tokens))

    def _blind(self, e: BackendEntry) -> BackendSnapshot:
        """What the gateway knows without metrics: its own in-flight count and the configured or nominal
        KV (for a backend never heard from, its snapshot says just that). Failing open, every decision
        reads these: kept until a producer drops the entry's snapshot."""
        return e.blind or self._rebuild(e, blind=True)

    @staticmethod
    def _unreported_kv(e: BackendEntry, profile: ModelProfile) -> int:
        """KV bytes of a backend that reports none: its configured capacity, else the model's estimate."""
        if e.kv_capacity_tokens is not None:
            return e.kv_capacity_tokens * profile.kv_bytes_per_token
        return perf_model.kv_capacity_bytes(profile, e.gpu)

    def context(self, e: BackendEntry, model: str | None = None) -> tuple[int, str]:
        """(tokens, source): the context length a backend serves, prompt + completion (of `model`, one of
        those it serves; None: its first). The engine reports its first model's; another model's is the
        entry's `max_model_len` where set, else that model's catalog context."""
        other = self._other_contexts.get(e.id)
        if other is not None and model in other:
            if e.max_model_len is not None:
                return e.max_model_len, "config"
            return other[model], "catalog"
        if e.reported.max_model_len > 0:
            return e.reported.max_model_len, "engine"
        if e.max_model_len is not None:
            return e.max_model_len, "config"
        return self._fixed[e.id].max_context, "catalog"

    def kv_capacity(self, e: BackendEntry) -> tuple[int, int, str]:
        """(free bytes, total bytes, source). A reported estimate gives way to the entry's configured
        capacity (free scaled by the reported fraction free); before any report, the configured capacity
        or the model's estimate, all free."""
        r = e.reported
        if e.last_heartbeat is None:
            kv = self._fixed[e.id].unreported_kv_bytes
            return kv, kv, "config" if e.kv_capacity_tokens is not None else "estimate"
        if r.kv_source == "estimate" and e.kv_capacity_tokens is not None:
            total = e.kv_capacity_tokens * self._fixed[e.id].kv_bytes_per_token
            free = int(total * r.kv_free_bytes / r.kv_total_bytes) if r.kv_total_bytes else total
            return free, total, "config"
        return r.kv_free_bytes, r.kv_total_bytes, r.kv_source or "unreported"

    def largest_context(self, model: str | None = None) -> int:
        """The longest context any backend that can take language work (for `model`; None: any) serves
        (0: none); read per request, so kept until a registration or a heartbeat with another max_model_len."""
        found = self._largest_context.get(model)
        if found is None:
            found = self._largest_context[model] = max(
                (self.context(e, model)[0] for e in self._entries.values()
                 if e.takes_language and _serves_model(e, model)), default=0
            )
        return found

    def language_backlog(self, model: str | None = None) -> int:
        """Requests waiting (admitted, not yet running) across the language pool (of `model`; None: every
        backend), as last reported."""
        return self._pool(("language", "both"), model).backlog()

    def snapshot(self, entry: BackendEntry) -> BackendSnapshot:
        return entry.cached or self._rebuild(entry)

    def mean_service_s(self, entry: BackendEntry) -> float:
        """T̄_service: what a managed engine measures (admission to last token, model time), else the
        gateway's learned service time (prior until samples come). An external engine's reported
        figure (vLLM's e2e latency) includes queueing, so it is not used."""
        if entry.reported.mean_service_s > 0 and not entry.external:
            return entry.reported.mean_service_s
        return entry.speed.service_s

    def _rebuild(self, e: BackendEntry, blind: bool = False) -> BackendSnapshot:
        """The entry's snapshot (`blind`: as `_blind` reads it), built and cached."""
        fixed = self._fixed[e.id]
        kv = (0, 0) if blind else self.kv_capacity(e)[:2]
        snap = build_snapshot(e, fixed, kv, self.mean_service_s(e), self.context(e)[0], blind)
        if blind:
            e.blind = snap
        else:
            e.cached = snap   # not through the `snapshot` setter: only dropping a snapshot is news to the pools
        return snap
