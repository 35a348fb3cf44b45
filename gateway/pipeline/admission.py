"""The admission queue: where requests wait when every backend is saturated.

Bounded (`max_waiting`; beyond it a request gets 429 with Retry-After at once), ordered by deadline
then arrival. Capacity is signalled by the pipeline whenever a request finishes; the head of the
queue re-checks saturation and goes, the rest keep waiting until their deadline (then 429).
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


@dataclass(order=True)
class _Waiter:
    deadline: float
    seq: int
    wake: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._heap)

    async def wait_for_capacity(self, saturated: Callable[[], bool], deadline: float) -> None:
        """Return when not `saturated()` and this request is at the head; raise Overloaded if it can't."""
        if not self._heap and not saturated():
            return
        if len(self._heap) >= self.config.max_waiting:
            raise Overloaded(f"every backend is saturated and {len(self._heap)} requests are already queued")
        waiter = _Waiter(min(deadline, self._clock() + self.config.max_wait_s), next(self._seq))
        heapq.heappush(self._heap, waiter)
        try:
            while not (self._heap[0] is waiter and not saturated()):
                remaining = waiter.deadline - self._clock()
                if remaining <= 0:
                    raise Overloaded("every backend stayed saturated until the request's deadline")
                waiter.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await waiter.wake.wait()
        finally:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
            self.notify()

    def notify(self) -> None:
        """Capacity may have freed up: wake the head of the queue."""
        if self._heap:
            self._heap[0].wake.set()
