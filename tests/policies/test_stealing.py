"""Which vision GPUs may take language work: backlog ≥ τ, idle encoder, decoder loaded, bounded assistance."""

from __future__ import annotations

import dataclasses

from gateway.routing.policies.contracts import BackendSnapshot
from gateway.routing.policies.stealing import stealers
from tests.snapshots import snapshot


def vision(backend_id: str, *, queue_depth: int = 0, vision_backlog: int = 0, steal: bool = True) -> BackendSnapshot:
    s = snapshot(backend_id, "RTX-4090", role="vision", queue_depth=queue_depth, vision_backlog=vision_backlog)
    return dataclasses.replace(s, steal=steal)


def ids(found: list[BackendSnapshot]) -> list[str]:
    return [b.id for b in found]


def test_no_stealing_below_the_language_backlog_threshold() -> None:
    pool = [vision("v0"), vision("v1")]
    assert ids(stealers(pool, language_backlog=15, threshold=16)) == []
    assert ids(stealers(pool, language_backlog=16, threshold=16)) == ["v0", "v1"]


def test_vision_work_first_and_only_gpus_with_the_decoder_loaded() -> None:
    pool = [vision("busy", vision_backlog=576), vision("encoder-only", steal=False), vision("idle")]
    assert ids(stealers(pool, language_backlog=100, threshold=16)) == ["idle"]


def test_a_stealer_holds_at_most_max_batch_language_requests() -> None:
    pool = [vision("full", queue_depth=16), vision("room", queue_depth=15)]
    assert ids(stealers(pool, language_backlog=100, threshold=16)) == ["room"]   # the paper's 16 by default
    assert ids(stealers(pool, language_backlog=100, threshold=16, max_batch=4)) == []
    assert ids(stealers(pool, language_backlog=100, threshold=16, max_batch=17)) == ["full", "room"]
