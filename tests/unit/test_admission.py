from __future__ import annotations

import asyncio

import pytest

from gateway.config.sections import AdmissionConfig
from gateway.pipeline.admission import AdmissionQueue
from gateway.requests.errors import Overloaded


async def test_passes_straight_through_when_not_saturated() -> None:
    q = AdmissionQueue(AdmissionConfig())
    await asyncio.wait_for(q.wait_for_capacity(lambda: False, deadline=1e9), 1)
    assert q.waiting == 0


async def test_full_queue_is_429_at_once() -> None:
    q = AdmissionQueue(AdmissionConfig(max_waiting=0))
    with pytest.raises(Overloaded):
        await q.wait_for_capacity(lambda: True, deadline=1e9)


async def test_order_is_deadline_then_arrival_and_capacity_wakes_the_head() -> None:
    loop = asyncio.get_running_loop()
    now = loop.time()
    q = AdmissionQueue(AdmissionConfig(max_waiting=10), clock=loop.time)
    capacity = {"free": 0}
    order: list[str] = []

    def saturated() -> bool:
        return capacity["free"] == 0

    async def request(name: str, deadline: float) -> None:
        await q.wait_for_capacity(saturated, deadline)
        capacity["free"] -= 1
        order.append(name)

    tasks = [asyncio.create_task(request(n, now + d)) for n, d in (("late", 30), ("early", 10), ("later", 30))]
    await asyncio.sleep(0.01)
    assert q.waiting == 3 and order == []
    for _ in range(3):
        capacity["free"] += 1
        q.notify()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == ["early", "late", "later"]


async def test_deadline_expiry_is_overloaded() -> None:
    loop = asyncio.get_running_loop()
    q = AdmissionQueue(AdmissionConfig(), clock=loop.time)
    with pytest.raises(Overloaded):
        await q.wait_for_capacity(lambda: True, deadline=loop.time() + 0.05)
    assert q.waiting == 0
