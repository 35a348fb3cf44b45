from __future__ import annotations

from gateway.config.sections import BreakerConfig
from gateway.pipeline.breakers import Breakers, State


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_recovers_through_one_probe() -> None:
    clock = Clock()
    b = Breakers(BreakerConfig(failure_threshold=3, open_s=5.0), clock)
    for _ in range(2):
        b.on_failure("a")
    assert b.state("a") is State.CLOSED and b.blocked() == []
    b.on_failure("a")
    assert b.state("a") is State.OPEN and b.blocked() == ["a"]
    clock.now = 4.9
    assert b.blocked() == ["a"]
    clock.now = 5.0
    assert b.state("a") is State.HALF_OPEN and b.blocked() == []
    b.on_dispatch("a")                      # the probe is out: nobody else goes there
    assert b.blocked() == ["a"]
    b.on_success("a")
    assert b.state("a") is State.CLOSED and b.blocked() == []


def test_failed_probe_reopens() -> None:
    clock = Clock()
    b = Breakers(BreakerConfig(failure_threshold=1, open_s=1.0), clock)
    b.on_failure("a")
    clock.now = 1.0
    b.on_dispatch("a")
    b.on_failure("a")
    assert b.state("a") is State.OPEN
    clock.now = 1.5
    assert b.blocked() == ["a"]


def test_success_resets_the_count() -> None:
    b = Breakers(BreakerConfig(failure_threshold=2), Clock())
    b.on_failure("a")
    b.on_success("a")
    b.on_failure("a")
    assert b.state("a") is State.CLOSED
