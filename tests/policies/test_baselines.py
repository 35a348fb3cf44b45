"""The classic baselines (round robin, shortest queue, power of two, capacity proportional) and the registry."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from common.errors import ConfigError
from gateway.routing.policies import REGISTRY, build_policy
from gateway.routing.policies.capacity_proportional import CapacityProportional
from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from gateway.routing.policies.power_of_two import PowerOfTwo, PowerOfTwoParams
from gateway.routing.policies.round_robin import RoundRobin
from gateway.routing.policies.shortest_queue import ShortestQueue
from tests.snapshots import cluster, random_cluster, snapshot

REQ = RequestProfile(request_id="r", input_tokens=512)


def with_queues(*depths: int) -> list[BackendSnapshot]:
    return [snapshot(f"b{i}", "A100-80GB", queue_depth=q) for i, q in enumerate(depths)]


# --- round_robin ---------------------------------------------------------------------------------


def test_round_robin_cycles_through_candidates_in_order() -> None:
    backends = cluster({"H100": 1, "A100-80GB": 1, "L40S": 1})
    p = RoundRobin()
    chosen = [p.choose(REQ, backends, now=0.0).backend.id for _ in range(7)]
    ids = [b.id for b in backends]
    assert chosen == ids * 2 + ids[:1]


def test_round_robin_ignores_load_and_survives_a_shrinking_pool() -> None:
    p = RoundRobin()
    busy = with_queues(100, 0)
    assert [p.choose(REQ, busy, now=0.0).backend.id for _ in range(2)] == ["b0", "b1"]
    assert p.choose(REQ, busy[:1], now=0.0).backend.id == "b0"
    assert p.choose(REQ, busy, now=0.0).costs == ()


# --- shortest_queue ------------------------------------------------------------------------------


def test_shortest_queue_picks_the_minimum() -> None:
    d = ShortestQueue().choose(REQ, with_queues(4, 2, 7, 1, 3), now=0.0)
    assert d.backend.id == "b3"
    assert [c.total for c in d.costs] == [4.0, 2.0, 7.0, 1.0, 3.0]
    assert d.cost == 1.0


def test_shortest_queue_breaks_ties_on_the_first_candidate() -> None:
    assert ShortestQueue().choose(REQ, with_queues(3, 1, 1, 2), now=0.0).backend.id == "b1"


def test_shortest_queue_on_random_clusters() -> None:
    rng = random.Random(5)
    p = ShortestQueue()
    for _ in range(100):
        backends = random_cluster(rng, rng.randint(1, 20))
        assert p.choose(REQ, backends, now=0.0).backend.queue_depth == min(b.queue_depth for b in backends)


# --- power_of_two --------------------------------------------------------------------------------


def _p2_sequence(seed: int, backends: list[BackendSnapshot], n: int = 200) -> list[str]:
    p = PowerOfTwo(PowerOfTwoParams(seed=seed))
    return [p.choose(REQ, backends, now=0.0).backend.id for _ in range(n)]


def test_power_of_two_is_reproducible_per_seed() -> None:
    backends = random_cluster(random.Random(1), 16)
    assert _p2_sequence(7, backends) == _p2_sequence(7, backends)
    assert _p2_sequence(7, backends) != _p2_sequence(8, backends)


def test_power_of_two_never_picks_the_worse_of_its_two_samples() -> None:
    rng = random.Random(2)
    p = PowerOfTwo(PowerOfTwoParams(seed=3))
    for _ in range(500):
        backends = random_cluster(rng, rng.randint(2, 12), max_queue=8)
        d = p.choose(REQ, backends, now=0.0)
        assert len(d.costs) == 2
        a, b = d.costs
        assert a.backend_id != b.backend_id
        assert d.backend.id in (a.backend_id, b.backend_id)
        assert d.backend.queue_depth == min(a.total, b.total)


def test_power_of_two_with_two_candidates_always_takes_the_shorter_queue() -> None:
    p = PowerOfTwo()
    assert {p.choose(REQ, with_queues(5, 0), now=0.0).backend.id for _ in range(50)} == {"b1"}


def test_power_of_two_with_one_candidate() -> None:
    only = with_queues(9)
    assert PowerOfTwo().choose(REQ, only, now=0.0).backend.id == "b0"


def test_power_of_two_spreads_samples_over_the_pool() -> None:
    counts = Counter(_p2_sequence(0, with_queues(*[0] * 8), n=800))
    assert set(counts) == {f"b{i}" for i in range(8)}


# --- capacity_proportional -----------------------------------------------------------------------


def test_capacity_proportional_shares_follow_tflops() -> None:
    backends = cluster({"H100": 1, "A100-80GB": 1, "L40S": 1})   # 989 + 312 + 362 = 1663 TFLOPS
    window = int(sum(b.tflops for b in backends))
    p = CapacityProportional()
    counts: Counter[str] = Counter()
    for k in range(1, 2 * window + 1):
        counts[p.choose(REQ, backends, now=0.0).backend.id] += 1
        for b in backends:   # smooth: every prefix stays within one pick of its exact share
            assert abs(counts[b.id] - k * b.tflops / window) < 1.0
        if k % window == 0:
            assert counts == {b.id: int(b.tflops) * k // window for b in backends}


def test_capacity_proportional_ignores_load() -> None:
    backends = cluster({"H100": 1, "L4": 1})
    backends[0] = dataclasses.replace(backends[0], queue_depth=1000)
    assert CapacityProportional().choose(REQ, backends, now=0.0).backend.id == "h100-0"


# --- registry ------------------------------------------------------------------------------------


def test_registry_builds_every_policy_by_name() -> None:
    assert {"heteroserve", "round_robin", "shortest_queue", "power_of_two", "capacity_proportional"} <= set(REGISTRY)
    backends = cluster({"H100": 1, "L40S": 1})
    for name in REGISTRY:
        p = build_policy(name)
        assert p.name == name
        d = p.choose(REQ, backends, now=0.0)
        assert d.policy == name
        assert d.backend in backends


def test_unknown_policy_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        build_policy("fastest_gpu")
    msg = str(exc.value)
    assert "unknown policy 'fastest_gpu'" in msg
    assert all(name in msg for name in REGISTRY)


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("heteroserve", {"w4": 1.0}, "w4"),
        ("round_robin", {"seed": 1}, "seed"),
        ("power_of_two", {"seeds": 1}, "seeds"),
        ("heteroserve", {"w1": -1.0}, "w1"),
        ("power_of_two", {"seed": "abc"}, "seed"),
    ],
)
def test_bad_policy_params_are_config_errors_naming_policy_and_key(
    name: str, params: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        build_policy(name, params)
    msg = str(exc.value)
    assert f"policy {name!r}" in msg
    assert expected in msg
