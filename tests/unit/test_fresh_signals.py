"""What counts as a fresh signal in the state table: a heartbeat that says its metrics are stale is
none, an upstream that does not answer the probe is no candidate, and readiness (`servable`) counts
only the backends that can serve now, not the stale ones kept to fail open on."""

from __future__ import annotations

import random

from common.metric_tables import SATURATED_QUEUE
from gateway.routing.backend_entry import serves
from gateway.routing.policies.contracts import Role
from gateway.routing.state_table import Reported, StateTable
from tests.snapshots import catalog

LANGUAGE: tuple[Role, ...] = ("language", "both")
INTERVAL_S, MISS_LIMIT = 0.1, 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(*external: str) -> tuple[StateTable, Clock]:
    clock = Clock()
    t = StateTable(catalog().model("llava-1.5-7b"), INTERVAL_S, MISS_LIMIT, clock=clock)
    for backend_id in external:
        t.register(backend_id, "language", catalog().gpu("H100"), address="http://10.0.0.5:8000", managed=False,
                   external=True)
    return t, clock


def test_a_report_of_stale_metrics_makes_the_backend_stale_at_once_and_routing_fails_open() -> None:
    t, _ = table("up-0")
    t.apply_heartbeat("up-0", 1, "", Reported(seq=1, waiting=3))
    assert [(b.id, b.queue_depth) for b in t.candidates(LANGUAGE)] == [("up-0", 3)] and not t.failing_open
    # the scraper (or agent) still heartbeats, but says its last good scrape is too old
    t.apply_heartbeat("up-0", 2, "", Reported(seq=2, waiting=SATURATED_QUEUE))
    assert not t.is_healthy(t.get("up-0"))   # type: ignore[arg-type]
    assert [(b.id, b.queue_depth) for b in t.candidates(LANGUAGE)] == [("up-0", 0)]   # its in-flight count
    assert t.failing_open
    assert t.servable(LANGUAGE) == 0            # nothing says it can serve ...
    t.set_reachable("up-0", True)
    assert t.servable(LANGUAGE) == 1            # ... until its upstream answers the probe
    t.apply_heartbeat("up-0", 3, "", Reported(seq=3, waiting=1))
    assert [(b.id, b.queue_depth) for b in t.candidates(LANGUAGE)] == [("up-0", 1)] and not t.failing_open


def test_an_upstream_that_does_not_answer_is_no_candidate_and_not_ready() -> None:
    t, clock = table("up-0", "up-1")
    assert {b.id for b in t.candidates(LANGUAGE)} == {"up-0", "up-1"}   # never heard: failing open
    assert t.servable(LANGUAGE) == 0
    t.set_reachable("up-0", False)
    t.set_reachable("up-1", True)
    assert [b.id for b in t.candidates(LANGUAGE)] == ["up-1"] and t.servable(LANGUAGE) == 1
    # fresh metrics do not make up for an upstream the gateway cannot reach
    t.apply_heartbeat("up-0", 1, "", Reported(seq=1))
    assert not t.is_healthy(t.get("up-0"))   # type: ignore[arg-type]
    assert [b.id for b in t.candidates(LANGUAGE)] == ["up-1"]
    t.set_reachable("up-1", False)
    assert not t.candidates(LANGUAGE) and t.servable(LANGUAGE) == 0
    t.set_reachable("up-0", True)
    assert [b.id for b in t.candidates(LANGUAGE)] == ["up-0"] and t.servable(LANGUAGE) == 1
    clock.now += MISS_LIMIT * INTERVAL_S * 2    # its metrics go stale; it still answers: served, and ready
    assert [b.queue_depth for b in t.candidates(LANGUAGE)] == [0] and t.failing_open
    assert t.servable(LANGUAGE) == 1
    t.set_reachable("up-0", None)               # a relaunch: nothing known yet
    assert t.servable(LANGUAGE) == 0 and [b.id for b in t.candidates(LANGUAGE)] == ["up-0"]


def test_candidates_follow_reachability_through_random_changes() -> None:
    """The column pools against a walk of the entries, while heartbeats, stale reports, probe results
    and the clock change at random."""
    rng = random.Random(3)
    ids = [f"up-{k}" for k in range(6)]
    t, clock = table(*ids)
    for seq in range(1, 400):
        backend_id = rng.choice(ids)
        action = rng.random()
        if action < 0.4:
            waiting = SATURATED_QUEUE if rng.random() < 0.2 else rng.randint(0, 9)
            t.apply_heartbeat(backend_id, seq, "", Reported(seq=seq, waiting=waiting))
        elif action < 0.7:
            t.set_reachable(backend_id, rng.choice([True, False, None]))
        else:
            clock.now += rng.uniform(0, MISS_LIMIT * INTERVAL_S)
        entries = [e for e in t.entries() if serves(e) and t.reachable(e.id) is not False]
        fresh = [e.id for e in entries if t.is_healthy(e)]
        expected = fresh + [e.id for e in entries if e.id not in fresh]
        assert [b.id for b in t.candidates(LANGUAGE)] == expected
        assert t.failing_open == (not fresh and bool(entries))
        assert t.servable(LANGUAGE) == len(fresh) + sum(
            1 for e in entries if e.id not in fresh and t.reachable(e.id) is True)


def test_a_backend_scraped_less_often_than_heartbeats_stays_heard_from_between_scrapes() -> None:
    """Scraped every 0.25 s on a table of 0.1 s heartbeats (miss limit 3): fresh for 3 x 0.25 s, not 0.3 s,
    so on-time scrapes never leave it looking stale (saturated) between them; the backend heartbeating at
    the table's interval keeps the table's window."""
    t, clock = table()
    t.register("scraped", "language", catalog().gpu("L40S"), address="http://s:1", managed=False, external=True,
               report_interval_s=0.25)
    t.register("agent", "language", catalog().gpu("L40S"), address="http://a:1", managed=False, external=True)
    for seq, backend in enumerate(("scraped", "agent")):
        t.apply_heartbeat(backend, seq + 1, "", Reported(seq=seq + 1, waiting=1))
    clock.now += 0.5   # past the table's window (0.3 s), within the scraped backend's (0.75 s)
    assert [b.id for b in t.candidates(LANGUAGE) if b.queue_depth < SATURATED_QUEUE] == ["scraped"]
    entry = t.get("scraped")
    assert entry is not None and t.is_healthy(entry)
    clock.now += 0.3   # past its own window too
    assert not t.is_healthy(entry)
    assert len(t.candidates(LANGUAGE)) == 2 and t.failing_open   # both stale: routed on in-flight counts


def test_a_stale_backend_beside_a_fresh_one_is_avoided_by_the_default_policy() -> None:
    """Kept as a candidate but saturated, a stale backend looked idle to marginal_delay (which reads no queue
    depth): a short prompt went to the upstream whose agent had died, not to the one reporting."""
    from gateway.routing.policies.contracts import RequestProfile
    from gateway.routing.policies.marginal_delay import MarginalDelay

    t, clock = table("up-fresh", "up-stale")
    t.set_reachable("up-stale", True)
    t.apply_heartbeat("up-fresh", 1, "", Reported(seq=1, waiting=2, running=6))
    t.apply_heartbeat("up-stale", 1, "", Reported(seq=1))
    clock.now += INTERVAL_S * MISS_LIMIT + 1   # up-stale's agent died; up-fresh reports on
    t.apply_heartbeat("up-fresh", 2, "", Reported(seq=2, waiting=2, running=6))
    candidates = t.candidates(LANGUAGE)
    assert [b.id for b in candidates] == ["up-fresh", "up-stale"] and not t.failing_open
    policy = MarginalDelay()
    for tokens in (20, 500, 3700):
        assert policy.choose(RequestProfile(f"r{tokens}", tokens, 16), candidates, clock.now).backend.id == "up-fresh"
