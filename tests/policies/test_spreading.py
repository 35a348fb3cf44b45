"""The spreading layer: near-best choices spread across replicas; everything else passes through."""

from __future__ import annotations

from collections import Counter

from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import RequestProfile
from gateway.routing.policies.spreading import Spreading
from tests.snapshots import snapshot

REQ = RequestProfile("r", 512)


def test_ties_spread_over_the_near_best_and_replicas_decorrelate() -> None:
    backends = [snapshot("h100-0", "H100"), snapshot("h100-1", "H100"), snapshot("l40s-0", "L40S", queue_depth=4)]
    bare = build_policy("heteroserve")
    assert {bare.choose(REQ, backends, 0.0).backend.id for _ in range(50)} == {"h100-0"}
    replicas = [Spreading(bare, 0.05, seed=s) for s in ("a", "b")]
    picks = [Counter(r.choose(REQ, backends, 0.0).backend.id for _ in range(200)) for r in replicas]
    for p in picks:
        assert set(p) == {"h100-0", "h100-1"} and min(p.values()) > 60   # never the far costlier L40S
    assert picks[0] != picks[1]


def test_a_clear_winner_and_non_argmin_policies_pass_through() -> None:
    backends = [snapshot("h100-0", "H100"), snapshot("h100-1", "H100", queue_depth=3)]
    spread = Spreading(build_policy("heteroserve"), 0.05, seed=1)
    assert {spread.choose(REQ, backends, 0.0).backend.id for _ in range(50)} == {"h100-0"}
    rr, wrapped = build_policy("round_robin"), Spreading(build_policy("round_robin"), 0.5, seed=1)
    assert [rr.choose(REQ, backends, 0.0).backend.id for _ in range(6)] == \
        [wrapped.choose(REQ, backends, 0.0).backend.id for _ in range(6)]
    assert wrapped.name == "round_robin"


def test_a_vetoed_backend_is_never_near_best() -> None:
    backends = [snapshot("h100-0", "H100", kv_free_bytes=0), snapshot("h100-1", "H100", queue_depth=1)]
    spread = Spreading(build_policy("heteroserve"), 1.0, seed=1)
    assert {spread.choose(REQ, backends, 0.0).backend.id for _ in range(50)} == {"h100-1"}
