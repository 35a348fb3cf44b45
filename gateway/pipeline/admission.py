"""The admission queue: where requests wait when every backend is saturated, served by weighted fair share.

Bounded (`max_waiting`; beyond it a request gets 429 with Retry-After at once), and every waiter
leaves with `Overloaded` at its own deadline (its request's, at most `max_wait_s` away): 429, or 504
`deadline_exceeded` where the request's own deadline was the sooner (`Pipeline.start` tells them
apart). Capacity is signalled by the pipeline whenever a request finishes; the head of the queue
re-checks saturation and goes, the rest keep waiting.

Who is the head: each tenant is a `Flow` with a priority class and a weight
(gateway/config/tenants.py). Classes are strict: while a request of a higher class waits, no lower
one goes. Within a class the flows share by start-time fair queueing (Goyal et al., SFQ): a flow's
next request carries a start tag, the larger of its previous finish tag and the class's virtual time
(the start tag of the request that went last) when the flow starts waiting; a request that goes
advances its flow's finish tag by cost / weight, where the cost is the tokens it is expected to take
(prompt + max_tokens) and is corrected to what it took when it ends (`Share.end`). The smallest
start tag goes first, so under contention flows get throughput in proportion to their weights, and
a flow that was idle starts at the class's virtual time: it goes next, with no credit saved up.
Within a flow, requests go by deadline then arrival. Saturation is each waiter's own: counted over the
backends open to its class (`min_priority` keeps a backend for a class and above), so a lower class
waits while a backend kept for a higher one is idle, and the higher classes, which may use every
backend a lower one may, are never held up by it.

The bound is shared fairly too: a request that finds the queue full pushes out the last request of
the flow holding the most places per weight, when that flow holds more than the newcomer's would
(and is of its class or a lower one); the one pushed out gets the 429 the newcomer would have got.

A request that finds nobody waiting and capacity free is not queued and not charged
(`Pipeline._admitted`): shares count only under contention. Nor is one whose tenant has fewer than
its `min_in_flight` requests under way (its guaranteed concurrency, none by default) while no request
of a higher class waits: it goes at once, past a saturated pool, so a tenant's light traffic does not
wait for a heavy one's requests to finish. The pool then holds at most the tenants' `min_in_flight`
beyond the depth limit. Such a request is routed to the backend where its first token is predicted
soonest (`gateway.routing.policies.first_token.SoonestFirstToken`, `guaranteed_first_token`): every
backend is mid-step then, and its first token comes after that step, its prefill and one decode step
of the batch there, several times sooner on a fast GPU than on a slow one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config.sections import AdmissionConfig
from gateway.requests.errors import Overloaded


class FairTags:
    """A flow's tags in its class's virtual time, for start-time fair queueing (Goyal et al., SFQ): the
    admission queue's tenants (`Flow`) and the overload queue's (gateway/pipeline/overload.py)."""

    __slots__ = ("finish", "start", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.finish = 0.0   # the finish tag of its last request to go
        self.start = 0.0    # the start tag of its next one, while it has any waiting

    def begin(self, vtime: float) -> None:
        """It starts waiting at the class's virtual time `vtime`: no credit for the time it was idle."""
        self.start = max(self.finish, vtime)

    def serve(self, cost: float) -> float:
        """Its next request goes, taking `cost`: that request's start tag (the class's virtual time now)."""
        start = self.start
        self.finish = self.start = start + cost / self.weight
        return start


class Flow(FairTags):
    """One tenant as the queue sees it: its class and weight, its waiters (a heap by deadline, then
    arrival), and its tags in the class's virtual time."""

    __slots__ = ("active", "min_in_flight", "name", "priority", "waiters")

    def __init__(self, name: str, priority: int = 0, weight: float = 1.0, min_in_flight: int = 0) -> None:
        super().__init__(weight)
        self.name, self.priority, self.min_in_flight = name, priority, min_in_flight
        self.waiters: list[_Waiter] = []
        self.active = 0     # its requests between their Share and its end: waiting or under way

    @property
    def in_flight(self) -> int:
        """Its requests under way (admitted, not ended)."""
        return self.active - len(self.waiters)

    def charge(self, cost: float) -> None:
        """Account `cost` more (or less, when negative) of the class's capacity to this flow."""
        step = cost / self.weight
        self.finish += step
        if self.waiters:
            self.start += step


class Share:
    """One request's claim on its flow, from its arrival to its end (`end`, once): the cost it is expected
    to take, and what was charged when it left the queue (0: it never waited, so nothing is corrected)."""

    __slots__ = ("charged", "cost", "flow")

    def __init__(self, flow: Flow, cost: float) -> None:
        self.flow, self.cost, self.charged = flow, max(1.0, cost), 0.0
        flow.active += 1

    def end(self, actual: float) -> None:
        """The request ended having taken `actual`: correct its flow's charge to that."""
        self.flow.active -= 1
        if self.charged:
            self.flow.charge(actual - self.charged)
            self.charged = 0.0


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    share: Share = field(compare=False)
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)
    queued: bool = field(compare=False, default=True)
    pushed_out: bool = field(compare=False, default=False)


class _Class:
    __slots__ = ("flows", "vtime")

    def __init__(self) -> None:
        self.flows: set[Flow] = set()   # those with waiters
        self.vtime = 0.0


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._classes: dict[int, _Class] = {}
        self._waiting = 0
        self._seq = itertools.count()
        self._default = Flow("default")   # requests that come without a share

    @property
    def waiting(self) -> int:
        return self._waiting

    async def wait_for_capacity(self, saturated: Callable[[], bool], deadline: float,
                                share: Share | None = None) -> bool:
        """Return when not `saturated()` and this request is at the head; raise Overloaded if it can't.
        True: it went at once on its tenant's guaranteed concurrency, past the queue and the pool's depth."""
        if not self._waiting and not saturated():
            return False
        if share is not None and self._guaranteed(share.flow):
            return True
        share = share or Share(self._default, 1.0)
        if self._waiting >= self.config.max_waiting and not self._push_out(share.flow):
            raise Overloaded(f"every backend is saturated and {self._waiting} requests are already queued")
        waiter = _Waiter(min(deadline, self._clock() + self.config.max_wait_s), next(self._seq), share)
        self._push(waiter)
        try:
            while not (self._head() is waiter and not saturated()):
                if waiter.pushed_out:
                    raise Overloaded(f"every backend is saturated and {self._waiting} requests are queued; this "
                                     "one gave its place to a tenant with fewer waiting")
                remaining = waiter.deadline - self._clock()
                if remaining <= 0:
                    raise Overloaded("every backend stayed saturated until the request's deadline")
                waiter.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await waiter.wake.wait()
            self._leave(waiter, admitted=True)
        finally:
            if waiter.queued:
                self._leave(waiter, admitted=False)
            self.notify()
        return False

    def notify(self) -> None:
        """Capacity may have freed up: wake the head of the queue."""
        head = self._head()
        if head is not None:
            head.wake.set()

    def _guaranteed(self, flow: Flow) -> bool:
        """Its flow has fewer than `min_in_flight` under way besides this request, and no higher class waits."""
        return flow.in_flight - 1 < flow.min_in_flight and not any(
            c.flows for p, c in self._classes.items() if p > flow.priority)

    def _head(self) -> _Waiter | None:
        """The highest class's flow of the smallest start tag (ties: the earlier arrival); its first waiter."""
        best: _Class | None = None
        priority = 0
        for p, c in self._classes.items():
            if c.flows and (best is None or p > priority):
                best, priority = c, p
        if best is None:
            return None
        flow = min(best.flows, key=lambda f: (f.start, f.waiters[0].seq))
        return flow.waiters[0]

    def _push(self, waiter: _Waiter) -> None:
        flow = waiter.share.flow
        c = self._classes.get(flow.priority) or self._classes.setdefault(flow.priority, _Class())
        if not flow.waiters:
            flow.begin(c.vtime)
            c.flows.add(flow)
        heapq.heappush(flow.waiters, waiter)
        self._waiting += 1

    def _leave(self, waiter: _Waiter, *, admitted: bool) -> None:
        """Take `waiter` out of its flow; `admitted`: it goes (it is the head), and its flow is charged."""
        share = waiter.share
        flow = share.flow
        c = self._classes[flow.priority]
        if admitted:
            heapq.heappop(flow.waiters)
            c.vtime = flow.serve(share.cost)
            share.charged = share.cost
        else:
            flow.waiters.remove(waiter)
            heapq.heapify(flow.waiters)
        waiter.queued = False
        self._waiting -= 1
        if not flow.waiters:
            c.flows.discard(flow)

    def _push_out(self, newcomer: Flow) -> bool:
        """The queue is full: make room for `newcomer`'s request by pushing out the last request of the
        flow with the most waiting per weight, if that is more than the newcomer's flow would have."""
        victim: Flow | None = None
        for p, c in self._classes.items():
            if p > newcomer.priority:
                continue
            for f in c.flows:
                if victim is None or len(f.waiters) / f.weight > len(victim.waiters) / victim.weight:
                    victim = f
        if victim is None or victim is newcomer or (
                len(victim.waiters) / victim.weight <= (len(newcomer.waiters) + 1) / newcomer.weight):
            return False
        last = max(victim.waiters)
        self._leave(last, admitted=False)
        last.pushed_out = True
        last.wake.set()
        return True
