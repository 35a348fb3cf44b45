"""The admission queue under contention: strict priority between classes, weighted fair share (start-time
fair queueing) within one, deadline order within a tenant, the bound shared fairly; the deadline and
bound semantics of the plain queue kept. Capacity is freed one slot at a time by the test, so the order
is the queue's alone."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from gateway.config.sections import AdmissionConfig
from gateway.pipeline.admission import AdmissionQueue, Flow, Share
from gateway.requests.errors import Overloaded

pytestmark = pytest.mark.timeout(10)


class Rig:
    """A queue whose capacity the test hands out; `order` lists who went, in order."""

    def __init__(self, max_waiting: int = 1000, clock: Callable[[], float] | None = None) -> None:
        self.queue = AdmissionQueue(AdmissionConfig(max_waiting=max_waiting),
                                    clock=clock or asyncio.get_running_loop().time)
        self.free = 0
        self.order: list[str] = []
        self.refused: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    def saturated(self) -> bool:
        return self.free <= 0   # below 0: requests went past the saturated pool

    def arrive(self, name: str, share: Share, deadline: float = 1e9) -> None:
        async def request() -> None:
            try:
                await self.queue.wait_for_capacity(self.saturated, deadline, share)
            except Overloaded:
                self.refused.append(name)
                return
            self.free -= 1
            self.order.append(name)
        self.tasks.append(asyncio.create_task(request()))

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def release(self, n: int) -> None:
        for _ in range(n):
            self.free += 1
            self.queue.notify()
            await self.settle()


async def test_weights_share_the_capacity_within_a_class() -> None:
    rig = Rig()
    heavy, light = Flow("a", weight=3), Flow("b", weight=1)
    rig.free = 0
    for i in range(60):
        rig.arrive("a", Share(heavy, 100))
        rig.arrive("b", Share(light, 100))
        if i == 0:
            await rig.settle()   # the first arrival finds the pool saturated and queues
    await rig.settle()
    assert rig.queue.waiting == 120
    await rig.release(40)
    assert Counter(rig.order) == {"a": 30, "b": 10}
    assert (len(heavy.waiters), len(light.waiters)) == (30, 50)


async def test_cost_counts_tokens_and_is_corrected_by_what_was_used() -> None:
    """Equal weights: a flow whose requests are expected to take 4x the tokens goes 1/4 as often; once
    its requests settle at the small flow's size, its later ones go as often."""
    rig = Rig()
    big, small = Flow("big"), Flow("small")
    big_shares = [Share(big, 400) for _ in range(30)]
    for s in big_shares:
        rig.arrive("big", s)
    for _ in range(30):
        rig.arrive("small", Share(small, 100))
    await rig.settle()
    await rig.release(10)
    assert Counter(rig.order) == {"big": 2, "small": 8}
    for s in big_shares[:2]:   # each took 100 tokens, not 400: the difference is given back
        s.end(100)
    rig.order.clear()
    await rig.release(10)
    assert Counter(rig.order)["big"] >= 4


async def test_a_higher_class_always_goes_first_and_a_newcomer_gets_no_debt_or_credit() -> None:
    rig = Rig()
    batch, interactive, late = Flow("batch", priority=-1, weight=10), Flow("interactive", priority=1), Flow("late")
    for _ in range(5):
        rig.arrive("batch", Share(batch, 10))
    await rig.settle()
    await rig.release(2)
    assert rig.order == ["batch", "batch"]
    rig.arrive("interactive", Share(interactive, 10))
    rig.arrive("interactive", Share(interactive, 10))
    rig.arrive("late", Share(late, 10))
    await rig.settle()
    await rig.release(4)
    # interactive (class 1) first, then `late` (class 0, with no history), then batch (class -1)
    assert rig.order == ["batch", "batch", "interactive", "interactive", "late", "batch"]


async def test_within_a_tenant_deadline_then_arrival() -> None:
    rig = Rig()
    now = asyncio.get_running_loop().time()
    flow = Flow("t")
    for name, d in (("late", 30), ("early", 10), ("later", 30)):
        rig.arrive(name, Share(flow, 1), deadline=now + d)
    await rig.settle()
    await rig.release(3)
    assert rig.order == ["early", "late", "later"]


async def test_a_full_queue_pushes_out_the_tenant_holding_the_most_places() -> None:
    rig = Rig(max_waiting=4)
    heavy, light = Flow("heavy"), Flow("light")
    for i in range(4):
        rig.arrive(f"heavy-{i}", Share(heavy, 1))
    await rig.settle()
    rig.arrive("heavy-4", Share(heavy, 1))    # its own flow is the fullest: refused at once, as before
    rig.arrive("light-0", Share(light, 1))    # takes the place of heavy's last
    rig.arrive("light-1", Share(light, 1))    # heavy holds 3, light would hold 2: one more of heavy's
    rig.arrive("light-2", Share(light, 1))    # 2 against 3: light would hold more, refused
    await rig.settle()
    assert sorted(rig.refused) == ["heavy-2", "heavy-3", "heavy-4", "light-2"]
    assert rig.queue.waiting == 4
    await rig.release(4)
    assert sorted(rig.order) == ["heavy-0", "heavy-1", "light-0", "light-1"]


async def test_a_higher_class_is_never_pushed_out_by_a_lower_one() -> None:
    rig = Rig(max_waiting=2)
    high, low = Flow("high", priority=1), Flow("low")
    rig.arrive("high-0", Share(high, 1))
    rig.arrive("high-1", Share(high, 1))
    await rig.settle()
    rig.arrive("low-0", Share(low, 1))
    await rig.settle()
    assert rig.refused == ["low-0"] and rig.queue.waiting == 2


async def test_each_waiter_still_leaves_at_its_deadline() -> None:
    now = [100.0]
    rig = Rig(clock=lambda: now[0])
    flow = Flow("t")
    rig.arrive("short", Share(flow, 1), deadline=100.0 + 0.05)
    rig.arrive("long", Share(flow, 1), deadline=1e9)
    await rig.settle()
    now[0] = 101.0   # the injected clock passes the first deadline; its timer wakes it
    await asyncio.wait_for(asyncio.gather(rig.tasks[0]), 2)
    assert rig.refused == ["short"] and rig.queue.waiting == 1
    await rig.release(1)
    assert rig.order == ["long"]


async def test_a_tenant_below_its_guaranteed_concurrency_goes_past_a_saturated_pool() -> None:
    rig = Rig()
    heavy, light = Flow("heavy", min_in_flight=1), Flow("light", min_in_flight=1)
    held = Share(heavy, 1)   # one of heavy's under way: heavy has its guarantee
    for _ in range(4):
        rig.arrive("heavy", Share(heavy, 1))
    await rig.settle()
    await rig.release(1)   # heavy: two under way, three waiting
    assert rig.order == ["heavy"] and rig.queue.waiting == 3
    first = Share(light, 1)
    rig.arrive("light", first)     # nothing of light's under way: it goes at once, past the pool
    await rig.settle()
    assert rig.order == ["heavy", "light"] and rig.queue.waiting == 3
    rig.arrive("light-2", Share(light, 1))   # light has one under way: it queues, ahead of heavy's next
    await rig.settle()
    assert rig.queue.waiting == 4
    await rig.release(2)   # the first slot makes up for light's request past the pool
    assert rig.order == ["heavy", "light", "light-2"]
    first.end(1)
    held.end(1)
    assert light.in_flight == 1 and heavy.in_flight == 1   # light-2 and the heavy one admitted


async def test_the_guarantee_never_jumps_a_higher_class() -> None:
    rig = Rig()
    high, low = Flow("high", priority=1), Flow("low", min_in_flight=1)
    rig.arrive("high", Share(high, 1))
    await rig.settle()
    rig.arrive("low", Share(low, 1))
    await rig.settle()
    assert rig.order == [] and rig.queue.waiting == 2
    await rig.release(2)
    assert rig.order == ["high", "low"]
