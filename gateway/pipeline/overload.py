"""The overload queue: the gateway holds requests itself while every backend's first token is predicted late.

Past saturation an engine's own queue only grows: every request sent to it waits behind the others
there, on the backend it was sent to when it arrived, in arrival order, until most of them miss
their time to first token. Here a backend *takes* a request when its predicted TTFT there
(`predicted_ttft_s`: the wait for its KV, marginal_delay's T_kv, as a full cache admits it only as
others finish; the prompts ahead of it and its own at the backend's learned prefill speed, plus a
decode step) is at most `hold_above_s` and, with `protect_itl`, its prefill's calibrated stall leaves
every in-flight request there `itl_reserve_steps` decode steps of inter-token slack (`taking`). A
request no backend takes is held by the gateway instead, and released, earliest start deadline
first, when one does; it is then routed by the policy on the table as it stands at its release (so it
goes where capacity freed, not where it would have queued). A request that goes, at once or
released, goes to a backend that takes it (`OverloadQueue.route`: the policy's choice when that
backend takes it, else its choice among those that do): before, the policy could send a request let
go for one backend to another where its first token was predicted 1.2-1.6 s away after it had waited
up to 1 s. The engines' queues stay short and the waiting happens here, where requests can be
ordered by deadline.

The reserve: a stall exactly within a request's slack still breaks it often (its steps grow with the
batch and vary with noise, and the slack counts whole stalls only), so a backend takes a prefill only
where every slack there keeps `itl_reserve_steps` (4) decode steps ŝ beyond the stall.

Deadlines. A held request has a start deadline: arrival + min(max_wait_s, ttft_slo_s - hold_above_s),
sooner if the request's own deadline is. Released by then at a prediction of at most hold_above_s,
its first token is due within ttft_slo_s. One still held at its start deadline is refused then with
429 and Retry-After (`Overloaded`); one that finds `max_queued` held is refused at once. With
`refuse_at_once` (off by default), so is one that the held requests whose deadlines come first, at
the rate requests have recently been completing, would take past its start deadline: requests start
faster than they complete while batches absorb them, and of the requests that estimate refused on the
family benchmark at 1.0x, 90-100% started in time when held instead.

A request whose own prefill on an idle backend is predicted above hold_above_s everywhere (a very
long prompt) is held against that idle prediction instead: it goes once some backend has nothing
ahead of it. A request with images is never held: its first token waits on the vision pool's encode
too, which the prediction does not model (the admission queue still applies to it).

Tenants. Held requests go by their tenant's priority class first (gateway/config/tenants.py), as in
the admission queue: a higher class's request is released, as soon as a backend can take it, before
any lower class's, whatever their deadlines. Within a class the tenants share by weight, by start-time
fair queueing as in the admission queue (gateway/pipeline/admission.py): each tenant's next request
carries a start tag, the larger of its previous finish tag and the class's virtual time when it starts
being held, and a request released advances its tenant's tag by its expected tokens (prompt +
max_tokens) / weight; the smallest start tag goes first, and within a tenant the earliest start
deadline. With one tenant that is earliest start deadline first, as before tenants. (Unlike the
admission queue's, the charge is not corrected to the tokens a request took: the queue does not see
its end.) A request that finds the queue full (`max_queued`) takes the place of a lower class's held
request, of the lowest class held the one due last (refused with 429 then, as it would have been at
once had it come second); with none below its class, the place of the last-due request of its class's
tenant holding the most per weight, when that is more than its own tenant would then hold (as the
admission queue pushes out: a tenant that fills the queue does not keep a lighter one out); else it is
refused.

`OverloadQueue` is the pure part, on explicit times: the decisions (hold or go, where it may go,
refuse, release), the tenants' EDF heaps and tags, and the completion rate. The live gateway wraps it in `OverloadGate`
(asyncio waiters woken as first tokens come and requests end; gateway/pipeline/dispatch.py); the
discrete-event simulator (loadtest/sim/simulator.py) drives the same `OverloadQueue` on its virtual
clock, so the family benchmark measures this code.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from gateway.config.sections import OverloadConfig
from gateway.pipeline.admission import FairTags
from gateway.requests.errors import Overloaded
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile
from gateway.routing.policies.first_token import predicted_ttft_s, prefill_stall_s

T = TypeVar("T")


def taking(b: BackendSnapshot, profile: RequestProfile, hold_above_s: float, protect_itl: bool,
           reserve_steps: float = 0.0) -> bool:
    """Whether backend `b` can take `profile` now: its predicted TTFT there (its cached prefix not
    prefilled, its wait for KV counted) is at most `hold_above_s`, or at most its TTFT with nothing ahead
    (a prompt too long for the bound goes to an idle backend); and, with `protect_itl`, its prefill's
    calibrated stall there leaves every in-flight request's inter-token slack at least `reserve_steps`
    decode steps (ŝ there)."""
    cached = profile.cached_tokens
    tokens = profile.input_tokens - cached.get(b.id, 0) if cached else profile.input_tokens
    p = b.learned_prefill_s_per_token or b.prefill_s_per_token
    ttft = predicted_ttft_s(b, tokens, profile.input_tokens + profile.max_output_tokens)
    if ttft > hold_above_s and ttft > tokens * p + b.decode_step_s:   # not even its TTFT with nothing ahead
        return False
    return not (protect_itl and b.itl_slack_s
                and b.itl_slack_s[0] < prefill_stall_s(b, tokens) + reserve_steps * b.decode_step_s)


def takes(candidates: Iterable[BackendSnapshot], profile: RequestProfile, hold_above_s: float,
          protect_itl: bool, reserve_steps: float = 0.0) -> bool:
    """Whether some candidate can take `profile` now (`taking`). O(N). With no candidate at all there is
    nothing to wait for: True (the router answers that no backend is available)."""
    seen = False
    for b in candidates:
        seen = True
        if taking(b, profile, hold_above_s, protect_itl, reserve_steps):
            return True
    return not seen


def takers(candidates: Candidates, profile: RequestProfile, hold_above_s: float, protect_itl: bool,
           reserve_steps: float = 0.0) -> Candidates:
    """The candidates that can take `profile` now (`taking`), in order: `candidates` itself when all or
    none of them can (none: it was let go without one, or has images), else the subset, its columns
    taken, not rebuilt. O(N)."""
    rows = [k for k, b in enumerate(candidates) if taking(b, profile, hold_above_s, protect_itl, reserve_steps)]
    if not rows or len(rows) == len(candidates):
        return candidates
    return candidates.take(np.array(rows, dtype=np.intp))


@dataclass(order=True, slots=True)
class Held(Generic[T]):
    """One held request: its tenant's class (higher first), its start deadline, its arrival (its
    tenant's heap's order), and what its holder needs."""

    rank: int   # minus its tenant's priority class: a higher class is held ahead of every lower one
    due: float
    seq: int
    profile: RequestProfile = field(compare=False)
    item: T = field(compare=False)
    flow: _Flow[T] = field(compare=False, repr=False)
    queued: bool = field(compare=False, default=True)
    pushed_out: str = field(compare=False, default="")   # whose request took its place ("": none did)


class _Flow(FairTags, Generic[T]):
    """One tenant's held requests in one class: a heap by start deadline, then arrival (entries taken
    out are popped when they reach its top), and its tags in the class's virtual time."""

    __slots__ = ("heap", "held")

    def __init__(self, weight: float) -> None:
        super().__init__(weight)
        self.heap: list[Held[T]] = []
        self.held = 0        # the entries of `heap` still queued

    def top(self) -> Held[T]:
        heap = self.heap
        while not heap[0].queued:
            heapq.heappop(heap)
        return heap[0]


class _Class(Generic[T]):
    """One priority class: its tenants' flows, those holding requests, and its virtual time (the start
    tag of the request released last)."""

    __slots__ = ("active", "flows", "vtime")

    def __init__(self) -> None:
        self.flows: dict[str, _Flow[T]] = {}
        self.active: list[_Flow[T]] = []
        self.vtime = 0.0


class OverloadQueue(Generic[T]):
    """The overload queue's decisions on explicit times; `T` is what the caller keeps per held request."""

    def __init__(self, config: OverloadConfig, on_push_out: Callable[[Held[T]], None] = lambda held: None) -> None:
        """`on_push_out(held)`: `held` was taken out of the full queue for another's request (its
        holder refuses it)."""
        self.config = config
        self._on_push_out = on_push_out
        self.window_s = min(config.max_wait_s, config.ttft_slo_s - config.hold_above_s)
        self._classes: dict[int, _Class[T]] = {}   # by rank
        self._held = 0
        self._seq = itertools.count()
        self._ends: deque[float] = deque(maxlen=config.rate_window)   # recent completion times
        self._last_due = -math.inf   # no held request's start deadline is later (while any is held)
        self._ranks: Counter[int] = Counter()   # held requests per class (rank)

    @property
    def held(self) -> int:
        return self._held

    def goes(self, candidates: Iterable[BackendSnapshot], profile: RequestProfile) -> bool:
        """Whether some candidate can take the request now (`takes`)."""
        c = self.config
        return takes(candidates, profile, c.hold_above_s, c.protect_itl, c.itl_reserve_steps)

    def takers(self, candidates: Candidates, profile: RequestProfile) -> Candidates:
        """The candidates that can take the request now (`takers`)."""
        c = self.config
        return takers(candidates, profile, c.hold_above_s, c.protect_itl, c.itl_reserve_steps)

    def route(self, choose: Callable[[Candidates], Decision], candidates: Candidates,
              profile: RequestProfile) -> Decision:
        """Where a request that goes (at once or released) is sent: the policy's choice (`choose`) when its
        backend can take the request (`taking`), else the policy's choice among the candidates that can
        (`takers`; all of them when none can, or when the request has images, which are not held). So a
        request the queue lets go for one backend is not sent to another where its first token is
        predicted late or its prefill breaks an inter-token slack. One `taking` test while the policy's
        choice takes it; O(N) tests and a second choice when not."""
        decision = choose(candidates)
        c = self.config
        if profile.image_tokens or taking(decision.backend, profile, c.hold_above_s, c.protect_itl,
                                          c.itl_reserve_steps):
            return decision
        within = self.takers(candidates, profile)
        return decision if within is candidates else choose(within)

    def offer(self, item: T, profile: RequestProfile, goes: bool, now: float, deadline: float = math.inf,
              priority: int = 0, tenant: str = "default", weight: float = 1.0) -> Held[T] | None:
        """A request arrives; `goes`: some backend can take it (`goes`). None: it goes now (nobody is
        held, and it can; or it has images, whose first token waits on the vision pool, which the
        prediction does not model); else it is held, in the returned place: behind every higher class's
        held requests and ahead of every lower class's, by its `tenant`'s share (`weight`) in its class.
        In a full queue it takes the place of a lower class's request, or of a heavier tenant's in its
        class (`on_push_out`). Raises
        `Overloaded` when the queue is full of its class and higher ones or, with `refuse_at_once`, it is
        predicted not to start in time."""
        if profile.image_tokens or (not self._held and goes):
            return None
        due = min(now + self.window_s, deadline)
        rank = -priority
        victim = None
        if self._held >= self.config.max_queued:
            victim = self._place_for(rank, tenant, weight)
            if victim is None:
                raise Overloaded(f"{self.why()}, and {self._held} requests are held",
                                 retry_after_s=self.retry_after_s(now))
        if self.config.refuse_at_once:
            if self._ranks.keys() <= {rank} and due >= self._last_due:   # one class, this one due last
                ahead = self._held
            else:
                ahead = sum(1 for h in self._queued() if (h.rank, h.due) <= (rank, due))
            wait = self.expected_wait_s(now, ahead)
            if now + wait > due:
                raise Overloaded(f"{self.why()}, and the {ahead} requests held ahead of this one would take about "
                                 f"{wait:.2g} s to start, past its start deadline",
                                 retry_after_s=self.retry_after_s(now))
        if victim is not None:
            self.take(victim)
            victim.pushed_out = ("a request of a higher priority class" if victim.rank > rank
                                 else "a tenant holding fewer requests for its weight")
            self._on_push_out(victim)
        c = self._classes.get(rank) or self._classes.setdefault(rank, _Class())
        flow = c.flows.get(tenant) or c.flows.setdefault(tenant, _Flow(weight))
        if not flow.held:
            flow.begin(c.vtime)
            c.active.append(flow)
        held = Held(rank, due, next(self._seq), profile, item, flow)
        heapq.heappush(flow.heap, held)
        flow.held += 1
        self._held += 1
        self._ranks[rank] += 1
        self._last_due = max(self._last_due, due)
        return held

    def _place_for(self, rank: int, tenant: str, weight: float) -> Held[T] | None:
        """The held request whose place a newcomer of class `rank` and `tenant` (of `weight`) takes in a
        full queue: of the lowest class held, below `rank`, the one due last (it would wait longest); with
        none below, of the tenant of its class holding the most per weight, the one due last, if that
        tenant holds more per weight than the newcomer's would with it; else None. O(held), on a full
        queue only."""
        lowest = max(self._ranks, default=rank)
        if lowest > rank:
            flows = self._classes[lowest].active
        elif (c := self._classes.get(rank)) is not None and c.active:
            heaviest = max(c.active, key=lambda f: f.held / f.weight)
            own = c.flows.get(tenant)
            if heaviest is own or heaviest.held / heaviest.weight <= ((own.held if own else 0) + 1) / weight:
                return None
            flows = [heaviest]
        else:
            return None
        return max((h for f in flows for h in f.heap if h.queued), key=lambda h: (h.due, h.seq))

    def _queued(self) -> Iterable[Held[T]]:
        """Every held request, in no order. O(held)."""
        return (h for rank in self._ranks for f in self._classes[rank].active for h in f.heap if h.queued)

    def why(self) -> str:
        """Why requests are held, for the refusals' messages."""
        itl = ", or its prefill would break a request's inter-token target there" if self.config.protect_itl else ""
        return (f"no backend can start this request in time (its first token predicted past "
                f"{self.config.hold_above_s:g} s{itl})")

    def head(self) -> Held[T] | None:
        """The next to go: of the highest class held, the tenant of the smallest start tag (ties: the
        earlier arrival), its earliest start deadline, then arrival. O(tenants held in that class)."""
        if not self._held:
            return None
        active = self._classes[min(self._ranks)].active
        if len(active) == 1:
            return active[0].top()
        return min((f.top() for f in active), key=lambda h: (h.flow.start, h.seq))

    def take(self, held: Held[T], released: bool = False) -> None:
        """`held` leaves the queue: `released` (it is the head, and goes: its tenant is charged), refused
        or gone (its client left)."""
        if not held.queued:
            return
        held.queued = False
        self._held -= 1
        self._ranks[held.rank] -= 1
        if not self._ranks[held.rank]:
            del self._ranks[held.rank]
        if not self._held:
            self._last_due = -math.inf
        flow, c = held.flow, self._classes[held.rank]
        flow.held -= 1
        if released:
            c.vtime = flow.serve(max(1.0, held.profile.input_tokens + held.profile.max_output_tokens))
        if not flow.held:
            flow.heap.clear()   # only entries taken out are left
            c.active.remove(flow)
        elif len(flow.heap) > 2 * flow.held + 16:   # taken out below its top (refused, pushed out): rebuilt
            flow.heap = [h for h in flow.heap if h.queued]
            heapq.heapify(flow.heap)

    def expired(self, now: float) -> list[Held[T]]:
        """Take out and return the held requests whose start deadline has come: its top while one tenant
        of one class is held, else found among them all (any tenant's may come first)."""
        if len(self._ranks) == 1 and len(active := self._classes[next(iter(self._ranks))].active) == 1:
            flow = active[0]
            out = []
            while flow.held and (top := flow.top()).due <= now:
                self.take(top)
                out.append(top)
            return out
        out = sorted(h for h in self._queued() if h.due <= now)
        for h in out:
            self.take(h)
        return out

    def finished(self, now: float) -> None:
        """A request ended: capacity freed, and the completion rate counts it."""
        self._ends.append(now)

    def completion_rate(self, now: float) -> float | None:
        """Requests completed per second over the last `rate_window` completions (up to now); None until two."""
        ends = self._ends
        if len(ends) < 2 or now <= ends[0]:
            return None
        return (len(ends) - 1) / (now - ends[0])

    def expected_wait_s(self, now: float, ahead: int) -> float:
        """How long `ahead` held requests and then one more take to start at the recent completion rate
        (0 while no rate is known: the request is held, and refused at its start deadline if it must be)."""
        rate = self.completion_rate(now)
        return (ahead + 1) / rate if rate else 0.0

    def retry_after_s(self, now: float) -> float:
        """When a refused client may try again: the time the held requests take to start, at least 1 s."""
        return max(1.0, self.expected_wait_s(now, self._held))


class OverloadGate:
    """The live gateway's overload queue: each held request's coroutine waits until it is the head and
    a backend's prediction for it is within the bound (`OverloadQueue.goes`), or until its start
    deadline (429). The pipeline calls `notify` when a first token comes or a request ends; the head
    also looks again every `recheck_s` (the heartbeat interval: speeds and reports change too)."""

    def __init__(self, config: OverloadConfig, clock: Callable[[], float], recheck_s: float) -> None:
        self.queue: OverloadQueue[asyncio.Event] = OverloadQueue(config, on_push_out=lambda held: held.item.set())
        self._clock = clock
        self._recheck_s = recheck_s

    @property
    def held(self) -> int:
        return self.queue.held

    async def wait(self, profile: RequestProfile, candidates: Callable[[], Iterable[BackendSnapshot]],
                   deadline: float, priority: int = 0, tenant: str = "default", weight: float = 1.0) -> bool:
        """Return when the request may go to a backend (True if it was held); raise Overloaded if it
        cannot. `candidates`: the language candidates as the table stands; `tenant` of `priority` and
        `weight`: whose share it takes (`OverloadQueue.offer`)."""
        queue = self.queue
        now = self._clock()
        held = queue.offer(asyncio.Event(), profile, queue.goes(candidates(), profile), now, deadline, priority,
                           tenant, weight)
        if held is None:
            return False
        try:
            while True:
                if held.pushed_out:
                    raise Overloaded(f"{queue.why()}, and its place in the full queue ({queue.config.max_queued} "
                                     f"held) went to {held.pushed_out}",
                                     retry_after_s=queue.retry_after_s(self._clock()))
                if queue.head() is held and queue.goes(candidates(), profile):
                    queue.take(held, released=True)
                    return True
                remaining = held.due - self._clock()
                if remaining <= 0:
                    raise Overloaded(f"{queue.why()} until its start deadline",
                                     retry_after_s=queue.retry_after_s(self._clock()))
                timeout = min(remaining, self._recheck_s) if queue.head() is held else remaining
                wake = held.item
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await wake.wait()
        finally:
            queue.take(held)   # no-op when released; a refused or cancelled request gives its place back
            self.notify()

    def notify(self) -> None:
        """A backend's prediction may have fallen: wake the head."""
        head = self.queue.head()
        if head is not None:
            head.item.set()

    def finished(self) -> None:
        """A request ended on a backend."""
        self.queue.finished(self._clock())
        self.notify()
