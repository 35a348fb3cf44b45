"""Herding: three replicas sharing state through the real Redis route a seeded trace like one gateway.

The same trace (seed 1, 25 req/s for 90 s of virtual time over one H100, two A100s and two L40S) is
routed by one gateway and by three replicas behind a round-robin balancer. Per-backend request shares
of the three sharing replicas must be within L1 distance 0.05 of the single gateway's; without sharing
(each replica on its own view, every heartbeat delivered to every replica) the distance is printed
and must be larger. docs/REPLICAS.md lists the distances over more seeds.
"""

from __future__ import annotations

import pytest

from testkit.herding import l1, route_trace, seeded_trace, shares
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix

pytestmark = pytest.mark.timeout(90)
SEED, RATE, DURATION_S = 1, 25.0, 90.0


async def test_three_sharing_replicas_route_like_one_and_isolated_ones_herd() -> None:
    trace = seeded_trace(SEED, RATE, DURATION_S)
    single = shares(await route_trace(trace, "single", 1))
    isolated = l1(shares(await route_trace(trace, "isolated", 3)), single)
    with redis_prefix("herding") as prefix:
        shared = l1(shares(await route_trace(trace, "shared", 3, prefix=prefix, redis_url=SYSTEM_REDIS)), single)
    print(f"L1 distance to one gateway over {len(trace.arrivals)} requests: "
          f"sharing {shared:.3f}, isolated {isolated:.3f}")
    assert len(single) == 5, single   # every tier is used, so the comparison says something
    assert shared <= 0.05
    assert isolated > shared
