"""`marginal_delay`: the default policy's cost terms and the choices they lead to."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from gateway.config.cluster import RoutingConfig
from gateway.routing.policies import build_policy
from gateway.routing.policies.candidates import KV_HEADROOM, LOOP_UP_TO, Candidates, near_lowest
from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from gateway.routing.policies.marginal_delay import MarginalDelay, MarginalDelayParams
from tests.snapshots import random_cluster, snapshot


def learned(b: BackendSnapshot, prefill_s_per_token: float, step_s: float, **signals: int) -> BackendSnapshot:
    return dataclasses.replace(b, learned_prefill_s_per_token=prefill_s_per_token, decode_step_s=step_s, **signals)


def fast_and_slow() -> tuple[BackendSnapshot, BackendSnapshot]:
    """An H100 that prefills 5x and decodes 3x faster than an L40S (learned, not datasheet)."""
    return (learned(snapshot("h100", "H100"), 0.06e-3, 0.010),
            learned(snapshot("l40s", "L40S"), 0.30e-3, 0.030))


def test_is_the_default_and_in_the_registry() -> None:
    assert RoutingConfig().policy == "marginal_delay"
    assert isinstance(build_policy("marginal_delay", {"w_stall": 0.5}), MarginalDelay)


def test_cost_is_first_token_plus_stall_plus_decode() -> None:
    h100, _ = fast_and_slow()
    b = dataclasses.replace(h100, in_flight=5, prefilling=2, prefill_backlog_tokens=1000)
    c = MarginalDelay(MarginalDelayParams(w_stall=0.2, w_decode=1.0, output_fraction=0.5)).cost(
        RequestProfile("r", 500, 40), b)
    first = (1000 + 500) * 0.06e-3 + 0.010
    stall = 0.2 * 5 * 500 * 0.06e-3    # all 5 in flight: the 2 prefilling ahead decode while it prefills
    assert c.prefill == pytest.approx(first + stall)
    assert c.queue == pytest.approx(0.5 * 40 * 0.010)
    assert c.total == pytest.approx(c.prefill + c.queue)


def test_long_prompts_go_where_prefill_is_cheap_short_ones_fill_the_slow_tier() -> None:
    h100, l40s = fast_and_slow()
    busy = dataclasses.replace(h100, in_flight=20, prefilling=4, prefill_backlog_tokens=8000)
    decoding = dataclasses.replace(l40s, in_flight=3)
    p = MarginalDelay()
    assert p.choose(RequestProfile("long", 3000, 32), [busy, decoding], 0.0).backend.id == "h100"
    assert p.choose(RequestProfile("short", 100, 32), [busy, decoding], 0.0).backend.id == "l40s"


def test_requests_still_prefilling_count_as_stalled() -> None:
    """Two backends alike but for when their requests got their first token: the ones still
    prefilling are served first (FIFO) and decode while the newcomer prefills, so they count the same."""
    h100, _ = fast_and_slow()
    decoding = dataclasses.replace(h100, id="decoding", in_flight=6, prefilling=0)
    prefilling = dataclasses.replace(h100, id="prefilling", in_flight=6, prefilling=6)
    p = MarginalDelay()
    r = RequestProfile("r", 2000, 16)
    assert p.cost(r, decoding).prefill == pytest.approx(p.cost(r, prefilling).prefill)
    idle = dataclasses.replace(h100, id="idle")
    assert p.cost(r, prefilling).prefill > p.cost(r, idle).prefill


def test_measured_speed_not_the_datasheet_decides() -> None:
    """Same GPU type, but one engine delivers a third of the prefill rate: it loses."""
    a = learned(snapshot("a", "H100"), 0.06e-3, 0.010)
    b = learned(snapshot("b", "H100"), 0.18e-3, 0.010)
    assert MarginalDelay().choose(RequestProfile("r", 2000, 16), [b, a], 0.0).backend.id == "a"


def test_the_prior_is_used_before_any_sample() -> None:
    b = snapshot("h100", "H100")
    assert b.learned_prefill_s_per_token == 0.0
    c = MarginalDelay().cost(RequestProfile("r", 1000, 0), b)
    assert c.prefill == pytest.approx(1000 * b.prefill_s_per_token)


def test_every_dispatch_moves_the_cost_so_a_burst_spreads() -> None:
    """The router's own backlog grows per dispatch (as the state table's leases do): no herding."""
    backends = [learned(snapshot(f"h{i}", "H100"), 0.06e-3, 0.010) for i in range(3)]
    p = MarginalDelay()
    chosen = []
    for k in range(9):
        d = p.choose(RequestProfile(f"r{k}", 2000, 16), backends, 0.0)
        i = next(j for j, b in enumerate(backends) if b.id == d.backend.id)
        b = backends[i]
        backends[i] = dataclasses.replace(b, in_flight=b.in_flight + 1, prefilling=b.prefilling + 1,
                                          prefill_backlog_tokens=b.prefill_backlog_tokens + 2000)
        chosen.append(d.backend.id)
    assert sorted(chosen.count(f"h{i}") for i in range(3)) == [3, 3, 3]


def test_a_prompt_goes_where_its_prefill_breaks_no_requests_inter_token_target() -> None:
    """Two L40S alike but for what they decode: a few short-output requests whose mean inter-token
    time a 3,000-token prefill (~0.9 s of stall) would push past the target, or long-output ones
    that absorb it. The long prompt goes to the second; a short one breaks nobody, either is fine."""
    _, l40s = fast_and_slow()
    fragile = dataclasses.replace(l40s, id="fragile", in_flight=3, itl_slack_s=(0.2, 0.3, 0.5))
    sturdy = dataclasses.replace(l40s, id="sturdy", in_flight=3, itl_slack_s=(4.0, 6.0, 9.0))
    p = MarginalDelay()
    long = RequestProfile("long", 3000, 16)
    assert p.choose(long, [fragile, sturdy], 0.0).backend.id == "sturdy"
    w_itl = MarginalDelayParams().w_itl
    assert p.cost(long, fragile).prefill - p.cost(long, sturdy).prefill == pytest.approx(3 * w_itl)
    short = RequestProfile("short", 100, 16)   # 0.03 s of stall: below every slack
    assert p.cost(short, fragile).total == p.cost(short, sturdy).total
    assert MarginalDelay(MarginalDelayParams(w_itl=0.0)).cost(long, fragile).total == p.cost(long, sturdy).total


def test_kv_veto_and_soft_kv_pressure() -> None:
    h100, l40s = fast_and_slow()
    capacity = h100.kv_total_bytes // h100.kv_bytes_per_token
    p = MarginalDelay()
    too_big = p.cost(RequestProfile("r", capacity, 1), h100)
    assert too_big.oom > 0 and too_big.total >= 1e6
    # requests already waiting for a whole cache's worth of tokens: about one turnover ahead
    full = dataclasses.replace(h100, kv_reserved_tokens=2 * capacity)
    free = p.cost(RequestProfile("r", 1000, 0), h100)
    pressed = p.cost(RequestProfile("r", 1000, 0), full)
    assert pressed.queue == pytest.approx((capacity + 1000) / capacity * h100.mean_service_s)
    assert pressed.total > free.total
    assert p.choose(RequestProfile("r", 1000, 0), [full, l40s], 0.0).backend.id == "l40s"


@pytest.mark.parametrize(("seed", "n"), [(seed, n) for seed in range(4) for n in (2, 40)])
def test_choose_on_columns_gives_the_costs_and_choice_of_the_one_candidate_form(seed: int, n: int) -> None:
    """choose() computes on arrays; cost() is the formula for one candidate: every term and the choice
    (the first lowest total) must be exactly the same, vetoes and KV waits included."""
    rng = random.Random(seed)
    base = list(random_cluster(rng, n))
    snapshots = []
    for b in base:
        kv = b.kv_bytes_per_token
        snapshots.append(dataclasses.replace(
            b, kv_total_bytes=rng.choice([0, 2_000 * kv, 60_000 * kv]), kv_free_bytes=rng.randint(0, 2_000) * kv,
            kv_reserved_tokens=rng.randint(0, 5_000), in_flight=rng.randint(0, 40), prefilling=rng.randint(0, 4),
            prefill_backlog_tokens=rng.randint(0, 8_000), decode_step_s=rng.choice([0.0, 0.02, 0.05]),
            learned_prefill_s_per_token=rng.choice([0.0, 1e-4, 3e-4]),
            itl_slack_s=tuple(sorted(rng.choice([0.0, 0.05, 0.3, 2.0]) for _ in range(rng.randint(0, 3)))),
        ))
    for length, new_tokens in ((16, 16), (1_500, 256), (3_000, 1_024), (40_000, 8)):
        request = RequestProfile("r", length, new_tokens)
        policy = MarginalDelay(rng=random.Random(7))   # the draw among near ties: the same as below
        decision = policy.choose(request, snapshots, now=0.0)
        expected = [policy.cost(request, b) for b in snapshots]
        assert list(decision.costs) == expected
        best = near_lowest([c.total for c in expected], random.Random(7), MarginalDelayParams().tie_tolerance)
        assert decision.backend is snapshots[best]
        assert decision.vetoed == tuple(c.backend_id for c in expected if c.oom > 0)


@pytest.mark.parametrize("short", [0, 1, 3, LOOP_UP_TO, LOOP_UP_TO + 1])
def test_the_few_candidates_short_of_kv_are_priced_as_the_one_candidate_form(short: int) -> None:
    """choose() prices T_kv and the veto one row at a time where only a few candidates lack the KV for the
    request (more: array operations): both give exactly the terms and the choice of cost()."""
    rng = random.Random(short)
    snapshots = []
    for k, b in enumerate(random_cluster(rng, 40)):
        kv = b.kv_bytes_per_token
        # the first `short` rows: the request (2,564 tokens) never fits 2,000, waits for the others
        capacity, reserved = (60_000, rng.randint(0, 1_500)) if k >= short else (rng.choice([2_000, 3_000, 4_000]),
                                                                                 rng.randint(1_500, 2_500))
        snapshots.append(dataclasses.replace(
            b, kv_total_bytes=capacity * kv, kv_free_bytes=capacity * kv, kv_reserved_tokens=reserved,
            in_flight=rng.randint(0, 8), decode_step_s=0.03, learned_prefill_s_per_token=rng.choice([1e-4, 3e-4]),
        ))
    request = RequestProfile("r", 2_500, 64, cached_tokens={"b1": 1_280, "b20": 640})
    policy = MarginalDelay(rng=random.Random(7))
    decision = policy.choose(request, snapshots, now=0.0)
    expected = [policy.cost(request, b) for b in snapshots]
    assert list(decision.costs) == expected
    assert np.count_nonzero(Candidates(snapshots).columns[KV_HEADROOM] < 2_564) == short   # those rows alone
    best = near_lowest([c.total for c in expected], random.Random(7), MarginalDelayParams().tie_tolerance)
    assert decision.backend is snapshots[best]
    assert decision.vetoed == tuple(c.backend_id for c in expected if c.oom > 0)
