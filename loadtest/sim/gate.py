"""The gateway's overload queue on a simulation's virtual clock, for every event loop that has one.

The queue's decisions are the live gateway's (`gateway.pipeline.overload.OverloadQueue`: hold, refuse,
the order of release); this adapter only says when they are asked, as the live pipeline asks them: on
each arrival, after each engine event (a first token or a completion moves the predictions; the live
gate is notified of both), and at a held request's start deadline when nothing else happens before it.
A refused request goes to the simulation's `on_refused` (which marks it rejected in its record); a
released one is dispatched by the simulation's own `dispatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gateway.config.sections import OverloadConfig
from gateway.pipeline.overload import OverloadQueue
from gateway.requests.errors import Overloaded
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile


class SimGate:
    def __init__(
        self, config: OverloadConfig,
        candidates: Callable[[float], Iterable[BackendSnapshot]],
        dispatch: Callable[[int, RequestProfile, float], None],
        on_refused: Callable[[int], None],
    ) -> None:
        """`candidates(now)`: the language candidates a decision would read now; `dispatch(i, profile,
        now)`: route request i (released); `on_refused(i)`: request i was refused (429)."""
        self.queue: OverloadQueue[int] = OverloadQueue(config, on_push_out=lambda held: self._refuse(held.item))
        self._candidates = candidates
        self._dispatch = dispatch
        self._on_refused = on_refused

    @property
    def held(self) -> int:
        return self.queue.held

    def arrive(self, i: int, profile: RequestProfile, now: float) -> bool:
        """Request i arrives: True if it goes now (the caller dispatches it), False if held or refused."""
        queue = self.queue
        if queue.held:
            self.release(now)
        try:
            return queue.offer(i, profile, queue.goes(self._candidates(now), profile), now) is None
        except Overloaded:
            self._refuse(i)
            return False

    def engine_event(self, now: float, completed: int) -> None:
        """An engine event with `completed` requests ending in it."""
        for _ in range(completed):
            self.queue.finished(now)
        if self.queue.held:
            self.release(now)

    def route(self, choose: Callable[[Candidates], Decision], candidates: Candidates,
              profile: RequestProfile) -> Decision:
        """The decision for a request let go: to a backend that takes it (`OverloadQueue.route`)."""
        return self.queue.route(choose, candidates, profile)

    def next_due(self) -> float:
        """The head's start deadline (only while some request is held)."""
        head = self.queue.head()
        assert head is not None
        return head.due

    def release(self, now: float) -> None:
        """Refuse the held requests whose start deadline came; release heads while a backend can take them."""
        queue = self.queue
        for held in queue.expired(now):
            self._refuse(held.item)
        while (head := queue.head()) is not None and queue.goes(self._candidates(now), head.profile):
            queue.take(head, released=True)
            self._dispatch(head.item, head.profile, now)

    def _refuse(self, i: int) -> None:
        self._on_refused(i)
