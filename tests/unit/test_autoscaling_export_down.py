"""Export mode's desired count comes back down once a burst's demand is gone (a fake clock): nothing
applies the scaler's steps there, so after a burst the desired count is above the engines serving, and a
step down is taken from the desired count, not from those engines (from them, one engine serving could
step down only at a need of exactly 0, which its own predicted first token never is)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.autoscaling import AutoscalingConfig, Pool
from gateway.control.autoscaler import PoolDemand, Scaler

pytestmark = pytest.mark.timeout(30)

TTFT_S = 0.05     # an idle engine's predicted first token: a need of 0.025 engines, never 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scaler(clock: FakeClock, **language: Any) -> Scaler:
    """The audit's pool: one engine, a queue mark of 2, an 8 s down delay."""
    return Scaler(AutoscalingConfig.model_validate({
        "mode": "export", "down_delay_s": 8,
        "pools": {"language": {"min": 1, "max": 4, "queue_per_engine": 2, **language}}}), clock)


def language(engines: int, queued: int) -> dict[Pool, PoolDemand]:
    return {"language": PoolDemand(engines, engines, queued=queued, predicted_ttft_s=TTFT_S)}


def ticks(s: Scaler, clock: FakeClock, seconds: int, queued: int, engines: int = 1) -> list[int]:
    """The desired count after each tick of a second, the engines staying as they are (export mode)."""
    out = []
    for _ in range(seconds):
        clock.now += 1
        out.append(s.decide(language(engines, queued))["language"].desired)
    return out


def test_desired_returns_to_min_after_a_burst_with_one_engine_serving() -> None:
    clock = FakeClock()
    s = scaler(clock)
    burst = ticks(s, clock, 5, queued=24)     # 24 requests held: 12 engines' worth on one
    assert burst[-1] == 4                     # max: the step an autoscaler outside would take
    idle = ticks(s, clock, 20, queued=0)
    assert idle[:7] == [4] * 7                # the down delay (8 s) is not over yet
    assert idle[-1] == 1                      # then back to min, though the engine's need is not 0


def test_desired_comes_down_as_far_as_a_managed_pool_would() -> None:
    """A need left after the burst (one request held: half an engine) keeps what the same pool would keep
    had its engines followed the desired count (0.25 on each of two: at the low mark 0.3 or under; 0.5
    on one: over it)."""
    clock = FakeClock()
    exported = scaler(clock)
    ticks(exported, clock, 5, queued=24)
    left = ticks(exported, clock, 30, queued=1)[-1]
    managed, engines = scaler(clock), 1
    for queued, seconds in ((24, 5), (1, 30)):
        for _ in range(seconds):
            clock.now += 1
            engines = managed.decide(language(engines, queued))["language"].desired
    assert left == engines == 2
