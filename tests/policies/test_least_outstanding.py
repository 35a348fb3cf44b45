"""`least_outstanding`: the capacity-weighted least-outstanding baseline (the 100-line proxy)."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import ConfigError
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import RequestProfile
from tests.snapshots import snapshot

FAST, SLOW = snapshot("fast", "H100"), snapshot("slow", "L40S")
R = RequestProfile("r", 500, 64)


def test_weighted_it_keeps_in_flight_counts_in_proportion_to_capacity() -> None:
    policy = build_policy("least_outstanding", {"weights": {"fast": 3.0, "slow": 1.0}})
    in_flight = {"fast": 0, "slow": 0}
    for _ in range(40):
        candidates = [dataclasses.replace(b, in_flight=in_flight[b.id]) for b in (FAST, SLOW)]
        in_flight[policy.choose(R, candidates, 0.0).backend.id] += 1
    assert in_flight == {"fast": 30, "slow": 10}


def test_unweighted_it_is_least_outstanding_and_ties_go_to_the_first() -> None:
    policy = build_policy("least_outstanding")
    assert policy.choose(R, [FAST, SLOW], 0.0).backend.id == "fast"
    busy = dataclasses.replace(FAST, in_flight=2)
    decision = policy.choose(R, [busy, SLOW], 0.0)
    assert decision.backend.id == "slow" and [c.total for c in decision.costs] == [3.0, 1.0]


def test_weights_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="weights"):
        build_policy("least_outstanding", {"weights": {"fast": 0.0}})
