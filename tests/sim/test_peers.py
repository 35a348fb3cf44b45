"""The emulated peers (loadtest/sim/peers.py): sglang-router's `cache_aware` and vllm-router's `power_of_two`
choose as their documented rules say, on small hand-made candidate sets."""

from __future__ import annotations

from collections import Counter

import pytest

from common.catalog import load_catalog
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from loadtest.sim import family as F
from loadtest.sim.peers import CacheAwareThresholds, SglangCacheAware, VllmPowerOfTwo, cache_aware_pick
from tests.snapshots import snapshot

REQ = RequestProfile(request_id="r", input_tokens=1000)


def flights(*counts: int, gpus: tuple[str, ...] = ("H100", "A100-80GB", "L40S")) -> list[BackendSnapshot]:
    """Backends b0, b1, ... with these requests in flight (the router's own counts)."""
    return [snapshot(f"b{k}", gpus[k % len(gpus)], in_flight=n) for k, n in enumerate(counts)]


def cached(**tokens: int) -> RequestProfile:
    return RequestProfile(request_id="r", input_tokens=1000, cached_tokens=tokens)


# --- sglang-router cache_aware ---------------------------------------------------------------------


def test_cache_aware_without_a_match_takes_the_least_loaded_first_on_a_tie() -> None:
    p = SglangCacheAware()
    assert p.choose(REQ, flights(3, 1, 2), now=0.0).backend.id == "b1"
    assert p.choose(REQ, flights(2, 1, 1), now=0.0).backend.id == "b1"
    # blind to speed: an idle L40S before a busier H100
    assert p.choose(REQ, flights(1, 1, 0), now=0.0).backend.id == "b2"


def test_cache_aware_follows_a_match_over_the_threshold_while_balanced() -> None:
    p = SglangCacheAware()
    busy = flights(40, 0, 0)            # 40 - 0 <= 64: balanced
    assert p.choose(cached(b0=301), busy, now=0.0).backend.id == "b0"
    assert p.choose(cached(b0=300), busy, now=0.0).backend.id == "b1"   # 30% is not past 0.3
    assert p.choose(cached(b0=400, b2=900), busy, now=0.0).backend.id == "b2"   # the longest match


def test_cache_aware_balances_only_when_both_thresholds_are_passed() -> None:
    p = SglangCacheAware()
    hit = cached(b0=900)
    # max - min > 64 and max > 1.5 x min: the least loaded, whatever the match
    assert p.choose(hit, flights(100, 35, 50), now=0.0).backend.id == "b1"
    # the absolute gap alone (210 - 140 = 70 > 64, but 210 is not past 1.5 x 140): still balanced
    assert p.choose(hit, flights(210, 140, 150), now=0.0).backend.id == "b0"
    # the relative gap alone (60 > 1.5 x 0, but 60 - 0 <= 64): still balanced
    assert p.choose(hit, flights(60, 0, 0), now=0.0).backend.id == "b0"


def test_cache_aware_pick_takes_its_thresholds() -> None:
    strict = CacheAwareThresholds(cache=0.5, balance_abs=4, balance_rel=1.2)
    assert cache_aware_pick([6, 1], (0, 600), 1000, strict) == 1     # 6 - 1 > 4 and 6 > 1.2: balance
    assert cache_aware_pick([4, 1], (0, 600), 1000, strict) == 0     # 3 <= 4: the match
    assert cache_aware_pick([4, 1], (0, 500), 1000, strict) == 1     # 50% is not past 0.5
    assert cache_aware_pick([4, 1], None, 1000, strict) == 1


# --- vllm-router power_of_two ----------------------------------------------------------------------


def test_power_of_two_takes_the_lower_polled_load_of_two_drawn() -> None:
    p = VllmPowerOfTwo(seed=3)
    two = flights(9, 2)
    assert {p.choose(REQ, two, now=0.1 * k).backend.id for k in range(20)} == {"b1"}
    d = VllmPowerOfTwo(seed=3).choose(REQ, flights(5, 5), now=0.0)
    assert d.backend.id == d.costs[0].backend_id        # a tie: the first drawn
    assert len(d.costs) == 2
    assert VllmPowerOfTwo().choose(REQ, flights(7), now=0.0).backend.id == "b0"


def test_power_of_two_reads_loads_up_to_one_poll_old() -> None:
    p = VllmPowerOfTwo(seed=1, poll_s=1.0)
    assert p.choose(REQ, flights(5, 0), now=0.2).backend.id == "b1"      # polled at 0.2: (5, 0)
    # the router has since sent b1 fifty requests and b0's finished: the poll of 0.2 still rules
    assert p.choose(REQ, flights(0, 50), now=0.9).backend.id == "b1"
    assert p.polled(flights(0, 50), now=0.99) == [5, 0]
    # the next poll is due at 1.0 (every multiple of poll_s)
    assert p.choose(REQ, flights(0, 50), now=1.0).backend.id == "b0"
    assert p.polled(flights(3, 3), now=1.7) == [0, 50]


def test_power_of_two_spreads_over_pairs_not_the_minimum() -> None:
    p = VllmPowerOfTwo(seed=7)
    counts = Counter(p.choose(REQ, flights(0, 10, 10), now=0.0).backend.id for _ in range(600))
    # b0 wins every pair it is drawn into (2 of the 3 pairs); the pair (b1, b2) goes to one of them
    assert 0.6 < counts["b0"] / 600 < 0.73
    assert counts["b1"] + counts["b2"] > 0
    with pytest.raises(ValueError, match="poll_s"):
        VllmPowerOfTwo(poll_s=0)


# --- in the engine family --------------------------------------------------------------------------


def test_without_shared_prefixes_cache_aware_routes_as_unweighted_least_outstanding() -> None:
    member = F.family()[0]
    settings = F.RunSettings(requests=150, warmup=0)
    catalog = load_catalog()
    peer = F.run(member, SglangCacheAware(), 1.0, 5, settings, catalog)
    lor = F.run(member, build_policy("least_outstanding", {}), 1.0, 5, settings, catalog)
    assert peer == lor
    p2 = F.run(member, VllmPowerOfTwo(seed=5), 1.0, 5, settings, catalog)
    assert p2["rejected"] == 0 and 0.0 < p2["goodput"] <= 1.0
