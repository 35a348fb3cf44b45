"""`common.itl_slack`: each request's room for prefill stall before it misses its inter-token target."""

from __future__ import annotations

import pytest

from common.itl_slack import InterTokenSlack

P, STEP = 0.3e-3, 0.04   # an L40S-like backend: s/prompt token, decode step


def test_a_request_can_take_its_tokens_times_the_margin_over_the_decode_step() -> None:
    s = InterTokenSlack(target_s=0.1)
    s.add(200, 9, P, STEP)
    assert s.slacks() == pytest.approx((8 * (0.1 - STEP),))   # its own prompt is not a stall to it


def test_later_prompts_use_up_the_slack_and_a_lost_request_is_left_out() -> None:
    s = InterTokenSlack(target_s=0.1)
    s.add(200, 5, P, STEP)        # 4 intervals: 0.24 s of slack
    s.add(100, 101, P, STEP)      # 100 intervals: 6 s
    s.add(600, 2, P, STEP)        # 0.06 s; 700 tokens' prefill after the first: it has 0.03 s left
    assert s.slacks() == pytest.approx((0.24 - 700 * P, 0.06, 6.0 - 600 * P))
    s.add(1000, 1, P, STEP)       # a single token: no inter-token time, but its prefill stalls the rest
    assert s.slacks() == pytest.approx((6.0 - 1600 * P,))   # the first two cannot meet the target any more
    assert len(s) == 3


def test_only_the_smallest_few_are_carried() -> None:
    s = InterTokenSlack(target_s=0.1)
    for m in (50, 40, 30, 20, 10):
        s.add(16, m, P, STEP)
    assert len(s.slacks()) == 3
    assert list(s.slacks()) == sorted(s.slacks())
    assert s.slacks(5)[-1] == pytest.approx(49 * (0.1 - STEP) - 4 * 16 * P)   # the first, stalled by the others


def test_a_backend_too_slow_for_the_target_gives_no_slack() -> None:
    s = InterTokenSlack(target_s=0.1)
    assert s.add(100, 50, P, 0.12) is not None
    assert s.slacks() == ()


def test_leaving_removes_exactly_that_request_and_an_empty_backend_restarts_its_clock() -> None:
    s = InterTokenSlack(target_s=0.1)
    a = s.add(3000, 20, P, STEP)
    b = s.add(3000, 20, P, STEP)
    single = s.add(10, 1, P, STEP)
    assert single is None
    s.remove(single)
    s.remove(a)
    assert s.slacks() == pytest.approx((19 * (0.1 - STEP) - 10 * P,))
    s.remove(b)
    assert len(s) == 0 and s.clock_s == 0.0
    s.add(100, 3, P, STEP)
    assert s.clock_s == pytest.approx(100 * P)
