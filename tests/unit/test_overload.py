"""The overload queue (gateway/pipeline/overload.py): which backends can take a request (and are the
ones it is routed among), EDF order, the bounds, refusals at once and at the start deadline with
Retry-After, release as capacity frees, and a held request whose client leaves giving its place back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pydantic
import pytest

from gateway.config.sections import OverloadConfig
from gateway.pipeline.overload import OverloadGate, OverloadQueue, takers, takes
from gateway.requests.errors import Overloaded
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile
from tests.snapshots import snapshot

P = 0.0001      # learned prefill s/token
STEP = 0.02     # learned decode step


def backend(name: str, backlog_tokens: int = 0, slacks: tuple[float, ...] = ()) -> BackendSnapshot:
    """A backend whose predicted TTFT for a prompt of L tokens is (backlog + L) * P + STEP."""
    return replace(snapshot(name, "H100"), learned_prefill_s_per_token=P, decode_step_s=STEP,
                   prefill_backlog_tokens=backlog_tokens, itl_slack_s=slacks)


def request(name: str = "r", tokens: int = 1000) -> RequestProfile:
    return RequestProfile(name, tokens, 64)


CONFIG = OverloadConfig(enabled=True, ttft_slo_s=2.0, hold_above_s=1.0, max_wait_s=1.0, max_queued=8, rate_window=4)


def config(**changes: float) -> OverloadConfig:
    return CONFIG.model_copy(update=changes)

BUSY = [backend("a", 20_000), backend("b", 30_000)]   # 2.12 s and 3.12 s for 1,000 tokens: past 1 s on both
ONE_FREE = [backend("a", 20_000), backend("b", 0)]


def test_a_backend_takes_a_request_while_its_predicted_first_token_is_within_the_bound() -> None:
    assert takes([backend("a")], request(), 1.0, protect_itl=False)
    assert not takes(BUSY, request(), 1.0, protect_itl=False)
    assert takes(ONE_FREE, request(), 1.0, protect_itl=False)
    assert takes([], request(), 1.0, protect_itl=False)   # no backend at all: nothing to wait for (503 follows)
    # A prompt whose own prefill is past the bound still goes where nothing is ahead of it, not elsewhere.
    assert takes([backend("a")], request(tokens=50_000), 1.0, protect_itl=False)
    assert not takes([backend("a", 1)], request(tokens=50_000), 1.0, protect_itl=False)
    # Its cached prefix is not prefilled: 15,000 tokens behind 2,000, 10,000 of them cached on a, fit a's bound.
    cached = replace(request(tokens=15_000), cached_tokens={"a": 10_000})
    assert takes([backend("a", 2000)], cached, 1.0, protect_itl=False)
    assert not takes([backend("a", 2000)], request(tokens=15_000), 1.0, protect_itl=False)


def test_with_protect_itl_a_backend_whose_prefill_would_break_a_slack_does_not_take_it() -> None:
    tight = backend("a", slacks=(0.05, 0.5))   # 1,000 tokens stall its requests 0.1 s: the first breaks
    roomy = backend("b", slacks=(0.2,))
    assert takes([tight], request(), 1.0, protect_itl=False)
    assert not takes([tight], request(), 1.0, protect_itl=True)
    assert takes([tight, roomy], request(), 1.0, protect_itl=True)
    assert takes([tight], request(tokens=100), 1.0, protect_itl=True)   # a 10 ms stall breaks none


def test_with_a_reserve_a_prefill_must_leave_each_slack_that_many_decode_steps() -> None:
    near = backend("a", slacks=(0.15,))   # 1,000 tokens stall 0.1 s: 0.05 s left, 2.5 steps of 20 ms
    assert takes([near], request(), 1.0, protect_itl=True)
    assert takes([near], request(), 1.0, protect_itl=True, reserve_steps=2)
    assert not takes([near], request(), 1.0, protect_itl=True, reserve_steps=3)
    assert takes([near], request(), 1.0, protect_itl=False, reserve_steps=3)   # the reserve is protect_itl's


def test_a_request_is_routed_among_the_backends_that_take_it() -> None:
    free, busy, tight = backend("free"), backend("busy", 20_000), backend("tight", slacks=(0.05,))
    every = Candidates([busy, free, tight])
    assert takers(every, request(), 1.0, protect_itl=True).ids == ("free",)
    assert takers(every, request(), 1.0, protect_itl=False).ids == ("free", "tight")
    some = takers(every, request(), 1.0, protect_itl=False)
    assert (some.columns == every.columns[:, [1, 2]]).all()   # the rows taken, not rebuilt
    assert takers(every, request(tokens=100), 5.0, protect_itl=True) is every   # all take it: the same object
    none = Candidates(BUSY)
    assert takers(none, request(), 1.0, protect_itl=True) is none   # none takes it (it was let go anyway): all
    q: OverloadQueue[str] = OverloadQueue(CONFIG)
    assert q.takers(every, request()).ids == ("free",)


def test_route_keeps_the_policys_choice_when_it_takes_the_request_else_chooses_among_those_that_do() -> None:
    free, busy, other = backend("free"), backend("busy", 20_000), backend("other")
    q: OverloadQueue[str] = OverloadQueue(CONFIG)
    asked: list[tuple[str, ...]] = []

    def first(within: Candidates) -> Decision:   # a policy that takes the first candidate
        asked.append(within.ids)
        return Decision(within[0], "first", ())

    assert q.route(first, Candidates([busy, free, other]), request()).backend.id == "free"
    assert asked == [("busy", "free", "other"), ("free", "other")]   # busy's first token is late: chosen again
    asked.clear()
    assert q.route(first, Candidates([free, busy]), request()).backend.id == "free" and len(asked) == 1
    asked.clear()
    assert q.route(first, Candidates(BUSY), request()).backend.id == "a" and len(asked) == 1   # none takes it
    with_images = RequestProfile("img", 1576, 64, image_tokens=576)   # not held, not restricted
    assert q.route(first, Candidates([busy, free]), with_images).backend.id == "busy"


def test_nobody_held_and_a_backend_free_goes_at_once_else_it_is_held_behind_those_waiting() -> None:
    q: OverloadQueue[str] = OverloadQueue(CONFIG)
    assert q.offer("r0", request(), True, now=0.0) is None
    held = q.offer("r1", request(), False, now=0.0)
    assert held is not None and q.held == 1
    assert q.offer("r2", request(), True, now=0.0) is not None   # no overtaking of the one held
    assert q.held == 2
    with_images = RequestProfile("img", 1576, 64, image_tokens=576)   # the vision pool is not modelled: never held
    assert q.offer("r3", with_images, False, now=0.0) is None and q.held == 2


def test_held_requests_leave_earliest_start_deadline_first_then_in_arrival_order() -> None:
    q: OverloadQueue[str] = OverloadQueue(CONFIG)
    for name, deadline in (("late", 10.0), ("soon", 0.4), ("late-too", 10.0), ("sooner", 0.2)):
        q.offer(name, request(name), False, now=0.0, deadline=deadline)
    order = []
    while (head := q.head()) is not None:
        q.take(head)
        order.append(head.item)
    assert order == ["sooner", "soon", "late", "late-too"]
    assert q.held == 0


def test_a_higher_tenant_class_is_released_first_and_a_lower_ones_deadline_still_comes() -> None:
    q: OverloadQueue[str] = OverloadQueue(config(refuse_at_once=True))
    for name, deadline in (("low-soon", 0.3), ("low-late", 10.0)):
        q.offer(name, request(name), False, now=0.0, deadline=deadline)
    q.offer("high", request("high"), False, now=0.0, deadline=0.9, priority=1)
    head = q.head()
    assert head is not None and head.item == "high"   # ahead of every class-0 request, whatever its deadline
    # the class-0 request due first is refused at its start deadline though it is not the head
    assert [h.item for h in q.expired(0.35)] == ["low-soon"] and q.held == 2
    # refuse_at_once counts only what is ahead of the newcomer: its class and higher ones, due sooner
    for t in (-0.65, -0.4, -0.15, 0.1):
        q.finished(t)   # three completions a second: one start every 1/3 s
    q.offer("high-2", request("high-2"), False, now=0.35, deadline=1.2, priority=1)   # 1 ahead: 0.67 s, in time
    with pytest.raises(Overloaded):   # 2 ahead (not low-late, due later): 1 s, past its deadline
        q.offer("low-2", request("low-2"), False, now=0.35, deadline=1.2)
    order = []
    while (head := q.head()) is not None:
        q.take(head)
        order.append(head.item)
    assert order == ["high", "high-2", "low-late"] and q.held == 0


def release(q: OverloadQueue[str], n: int) -> list[str]:
    """Release the head `n` times, as the gate does when a backend takes it; what went, in order."""
    out = []
    for _ in range(n):
        head = q.head()
        assert head is not None
        q.take(head, released=True)
        out.append(head.item)
    return out


def test_within_a_class_tenants_are_released_by_weight_and_each_tenants_by_deadline() -> None:
    """Held requests went by start deadline only, so while this queue held them (the default config's
    queue past the hold bound, ahead of the admission queue) tenants' weights did nothing: two tenants
    of weight 3 and 1 arriving alike went 1 : 1."""
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=100, max_wait_s=30.0, ttft_slo_s=40.0))
    for k in range(40):
        for tenant, weight in (("three", 3.0), ("one", 1.0)):
            q.offer(f"{tenant}-{k}", request(), False, now=k * 0.01, tenant=tenant, weight=weight)
    q.offer("one-urgent", request(), False, now=0.5, deadline=0.6, tenant="one", weight=1.0)
    released = release(q, 20)
    assert sum(r.startswith("three") for r in released) == 15
    assert released[released.index("one-urgent") - 1].startswith("three")   # its tenant's turn, then due first
    assert [r for r in released if r.startswith("one") and r != "one-urgent"] == ["one-0", "one-1", "one-2", "one-3"]
    # a tenant held only from now on starts at the class's virtual time: it goes among the next two, with
    # no credit saved up for its idle past (it does not take the next several turns)
    q.offer("late", request(), False, now=1.0, tenant="late", weight=1.0)
    q.offer("late-2", request(), False, now=1.0, tenant="late", weight=1.0)
    following = release(q, 4)
    assert "late" in following[:2] and "late-2" not in following[:3], following


def test_requests_pushed_out_under_a_higher_class_do_not_pile_up_in_the_queue() -> None:
    """Taken out below the top of their tenant's heap, they stayed there while that tenant held any, and
    every full-queue offer scanned them: 10,000 such cycles left 10,005 entries for 4 held."""
    pushed: list[str] = []
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=4, max_wait_s=30.0, ttft_slo_s=40.0),
                                          on_push_out=lambda held: pushed.append(held.item))
    q.offer("low-anchor", request(), False, now=0.0)   # due first of its class: never the one pushed out
    for k in range(2):
        q.offer(f"high-{k}", request(), False, now=0.0, priority=1)
    for k in range(2000):
        q.offer(f"low-{k}", request(), False, now=k * 1e-3)
        q.offer(f"high-x{k}", request(), False, now=k * 1e-3, priority=1)   # pushes low-k out
        head = q.head()
        assert head is not None and head.rank == -1
        q.take(head, released=True)
    assert len(pushed) == 2000 and "low-anchor" not in pushed and q.held == 3
    flows = [f for c in q._classes.values() for f in c.active]
    assert sum(len(f.heap) for f in flows) <= 2 * q.held + 40


def test_the_start_deadline_is_the_wait_bound_or_the_requests_own_deadline() -> None:
    config = OverloadConfig(enabled=True, ttft_slo_s=2.0, hold_above_s=1.5, max_wait_s=1.0)
    q: OverloadQueue[str] = OverloadQueue(config)
    a = q.offer("a", request(), False, now=10.0)
    b = q.offer("b", request(), False, now=10.0, deadline=10.2)
    assert a is not None and a.due == pytest.approx(10.5)   # 2.0 - 1.5 leaves 0.5 s to wait, below max_wait_s
    assert b is not None and b.due == pytest.approx(10.2)
    assert [h.item for h in q.expired(10.3)] == ["b"]
    assert [h.item for h in q.expired(10.5)] == ["a"] and q.held == 0


def test_beyond_max_queued_a_request_gets_429_with_retry_after_at_once() -> None:
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=2))
    q.offer("a", request(), False, now=0.0)
    q.offer("b", request(), False, now=0.0)
    with pytest.raises(Overloaded) as refused:
        q.offer("c", request(), False, now=0.0)
    assert refused.value.status == 429 and refused.value.code == "overloaded"
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1.0
    assert q.held == 2
    nothing = OverloadQueue[str](config(max_queued=0))
    assert nothing.offer("a", request(), True, now=0.0) is None   # max_queued 0 still lets through what can go
    with pytest.raises(Overloaded):
        nothing.offer("b", request(), False, now=0.0)


def test_a_full_queue_gives_a_higher_class_the_place_of_the_lowest_class_request_due_last() -> None:
    """A full queue refused a request of any class: a higher class's request waited nowhere while a lower
    class's held its place."""
    pushed: list[str] = []
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=3), on_push_out=lambda held: pushed.append(held.item))
    q.offer("low-soon", request(), False, now=0.0, deadline=0.5)
    q.offer("low-late", request(), False, now=0.0)
    q.offer("mid", request(), False, now=0.0, priority=1)
    with pytest.raises(Overloaded):   # its own class and higher ones fill it: refused, nothing pushed out
        q.offer("low-new", request(), False, now=0.0)
    assert pushed == [] and q.held == 3
    q.offer("high", request(), False, now=0.0, priority=2)   # the lowest class, the one due last, makes room
    assert pushed == ["low-late"] and q.held == 3
    q.offer("mid-2", request(), False, now=0.0, priority=1)
    assert pushed == ["low-late", "low-soon"]
    with pytest.raises(Overloaded):   # classes 1 and 2 only: a class-1 request finds none below it
        q.offer("mid-3", request(), False, now=0.0, priority=1)
    order = []
    while (head := q.head()) is not None:
        q.take(head)
        order.append(head.item)
    assert order == ["high", "mid", "mid-2"]


def test_a_full_queue_gives_a_lighter_tenant_of_the_class_the_place_of_the_heaviest_ones_request_due_last() -> None:
    """One tenant filling the queue kept every other tenant of its class out (429 at once), whatever
    their weights: within a class a full queue now pushes out as the admission queue does, the last-due
    request of the tenant holding the most per weight, while that is more than the newcomer's would hold."""
    pushed: list[str] = []
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=4, max_wait_s=30.0, ttft_slo_s=40.0),
                                          on_push_out=lambda held: pushed.append(held.item))
    for k in range(4):
        q.offer(f"heavy-{k}", request(), False, now=k * 0.01, tenant="heavy")
    q.offer("light-0", request(), False, now=0.1, tenant="light")   # heavy holds 4, light would hold 1
    assert pushed == ["heavy-3"] and q.held == 4
    q.offer("light-1", request(), False, now=0.1, tenant="light")   # 3 against 2
    assert pushed == ["heavy-3", "heavy-2"]
    with pytest.raises(Overloaded):   # 2 against 3: light would then hold more than heavy
        q.offer("light-2", request(), False, now=0.1, tenant="light")
    with pytest.raises(Overloaded):   # the heaviest's own request finds nobody heavier
        q.offer("heavy-4", request(), False, now=0.1, tenant="heavy")
    # by weight: a tenant of weight 3 would hold 1/3 a weight against 2 for each of the others (the first
    # of them the heaviest), so it takes heavy's place, its request due last
    q.offer("three-0", request(), False, now=0.2, tenant="three", weight=3.0)
    assert pushed == ["heavy-3", "heavy-2", "heavy-1"] and q.held == 4
    # a higher class's request takes the lower class's place due last, before any share is weighed
    q.offer("top", request(), False, now=0.3, priority=1, tenant="light")
    assert pushed[-1] == "three-0" and q.held == 4
    order = []
    while (head := q.head()) is not None:
        q.take(head)
        order.append(head.item)
    assert order[0] == "top" and sorted(order[1:]) == ["heavy-0", "light-0", "light-1"]


def test_a_request_predicted_not_to_start_in_time_is_held_by_default_and_refused_at_its_start_deadline() -> None:
    q: OverloadQueue[str] = OverloadQueue(CONFIG)   # start deadline: arrival + 1 s
    for t in (0.0, 0.5, 1.0, 1.5):   # 1.5 completions a second
        q.finished(t)
    q.offer("a", request(), False, now=2.0)
    held = q.offer("b", request(), False, now=2.0)   # 2 / 1.5 s past its start deadline, predicted: held still
    assert held is not None and held.due == pytest.approx(3.0) and q.held == 2
    assert [h.item for h in q.expired(3.0)] == ["a", "b"]


def test_with_refuse_at_once_a_request_that_cannot_start_before_its_deadline_is_refused_at_once() -> None:
    q: OverloadQueue[str] = OverloadQueue(config(refuse_at_once=True))   # start deadline: arrival + 1 s
    for t in (0.0, 0.5, 1.0, 1.5):   # 4 completions, 3 gaps over the 2 s up to now: 1.5 a second
        q.finished(t)
    assert q.completion_rate(2.0) == pytest.approx(1.5)
    q.offer("a", request(), False, now=2.0)   # 1 / 1.5 s ≈ 0.67 s: in time
    with pytest.raises(Overloaded) as refused:   # 2 / 1.5 s ≈ 1.33 s > 1 s: refused now, not in a second
        q.offer("b", request(), False, now=2.0)
    assert "start deadline" in refused.value.message
    assert refused.value.retry_after_s == pytest.approx(2 / 1.5)   # the held one and one more
    assert q.held == 1
    # A request with an earlier deadline counts only those that go before it, and is refused sooner.
    with pytest.raises(Overloaded):
        q.offer("c", request(), False, now=2.0, deadline=2.5)


def test_a_held_request_that_leaves_gives_its_place_back() -> None:
    q: OverloadQueue[str] = OverloadQueue(config(max_queued=1))
    held = q.offer("a", request(), False, now=0.0)
    assert held is not None
    with pytest.raises(Overloaded):
        q.offer("b", request(), False, now=0.0)
    q.take(held)   # its client left
    q.take(held)   # once only
    assert q.held == 0 and q.head() is None
    assert q.offer("b", request(), False, now=0.0) is not None


def test_config_refuses_a_hold_bound_at_or_past_the_slo() -> None:
    with pytest.raises(pydantic.ValidationError, match="hold_above_s"):
        OverloadConfig(ttft_slo_s=1.0, hold_above_s=1.0)


# -- the live gate: asyncio waiters --------------------------------------------------------------


class Cluster:
    """Candidates a test changes, and the gate that reads them, on the loop's clock."""

    def __init__(self, config: OverloadConfig = CONFIG) -> None:
        self.backends = list(BUSY)
        loop = asyncio.get_running_loop()
        self.gate = OverloadGate(config, loop.time, recheck_s=60.0)   # only notify wakes in these tests
        self.started: list[str] = []

    def candidates(self) -> list[BackendSnapshot]:
        return self.backends

    async def request(self, name: str, deadline: float = float("inf")) -> None:
        await self.gate.wait(request(name), self.candidates, deadline)
        self.started.append(name)
        self.backends = list(BUSY)   # the one released takes the capacity that freed

    def free_one(self) -> None:
        self.backends = list(ONE_FREE)
        self.gate.notify()


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(2.0):
        while not predicate():  # noqa: ASYNC110 - polling what the waiters record
            await asyncio.sleep(0.001)


async def test_held_requests_are_released_one_at_a_time_as_capacity_frees_earliest_deadline_first() -> None:
    c = Cluster(config(max_wait_s=30.0, ttft_slo_s=40.0))
    now = asyncio.get_running_loop().time()
    tasks = [asyncio.create_task(c.request(n, now + d)) for n, d in (("late", 20), ("early", 5), ("mid", 10))]
    await until(lambda: c.gate.held == 3)
    assert c.started == []
    for k in range(3):
        c.free_one()
        await until(lambda k=k: len(c.started) == k + 1)
        assert c.gate.held == 2 - k
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert c.started == ["early", "mid", "late"]


async def test_a_held_request_still_held_at_its_start_deadline_gets_429() -> None:
    c = Cluster()
    now = asyncio.get_running_loop().time()
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(c.request("r", deadline=now + 0.05), 2)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1.0
    assert c.gate.held == 0 and c.started == []


async def test_a_held_request_whose_place_a_higher_class_takes_gets_429_at_once() -> None:
    c = Cluster(config(max_wait_s=30.0, ttft_slo_s=40.0, max_queued=1))
    low = asyncio.create_task(c.request("low"))
    await until(lambda: c.gate.held == 1)
    high = asyncio.create_task(c.gate.wait(request("high"), c.candidates, float("inf"), priority=1))
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(low, 2)
    assert "higher priority class" in refused.value.message and refused.value.retry_after_s is not None
    assert c.gate.held == 1 and not high.done()
    c.free_one()
    assert await asyncio.wait_for(high, 2) is True and c.gate.held == 0


async def test_a_held_request_whose_place_a_lighter_tenant_takes_gets_429_saying_so() -> None:
    c = Cluster(config(max_wait_s=30.0, ttft_slo_s=40.0, max_queued=2))
    heavy = [asyncio.create_task(c.gate.wait(request(f"heavy-{k}"), c.candidates, float("inf"), tenant="heavy"))
             for k in range(2)]
    await until(lambda: c.gate.held == 2)
    light = asyncio.create_task(c.gate.wait(request("light"), c.candidates, float("inf"), tenant="light"))
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(heavy[1], 2)
    assert "a tenant holding fewer requests for its weight" in refused.value.message
    assert c.gate.held == 2 and not light.done() and not heavy[0].done()
    c.free_one()
    assert await asyncio.wait_for(heavy[0], 2) is True
    c.free_one()
    assert await asyncio.wait_for(light, 2) is True and c.gate.held == 0


async def test_a_cancelled_held_request_frees_its_slot_and_the_next_one_goes() -> None:
    c = Cluster(config(max_wait_s=30.0, ttft_slo_s=40.0, max_queued=2))
    first = asyncio.create_task(c.request("first"))
    second = asyncio.create_task(c.request("second"))
    await until(lambda: c.gate.held == 2)
    with pytest.raises(Overloaded):   # full
        await c.request("third")
    first.cancel()   # the client left
    with pytest.raises(asyncio.CancelledError):
        await first
    assert c.gate.held == 1
    c.free_one()
    await asyncio.wait_for(second, 2)
    assert c.started == ["second"] and c.gate.held == 0
