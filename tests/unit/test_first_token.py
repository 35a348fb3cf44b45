"""The predicted time to first token (gateway/routing/policies/first_token.py) counts the wait for KV: a
full cache delays a first token as a prefill backlog does, for every reader of the prediction (the
overload queue, the first-token limit, the soonest-first-token route, the autoscaler)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from gateway.routing.policies.first_token import SoonestFirstToken, kv_wait_s, predicted_ttft_s
from tests.snapshots import snapshot

P, STEP, SERVICE = 0.0001, 0.02, 4.0


def backend(name: str, free_tokens: int | None = None) -> BackendSnapshot:
    """An H100 with `free_tokens` of its KV free (None: all), p̂ P, ŝ STEP and T̄_service SERVICE."""
    b = snapshot(name, "H100", mean_service_s=SERVICE)
    per_token = b.kv_bytes_per_token
    free = b.kv_total_bytes if free_tokens is None else free_tokens * per_token
    return replace(b, learned_prefill_s_per_token=P, decode_step_s=STEP, kv_free_bytes=free)


def test_a_request_that_fits_the_free_cache_waits_for_no_kv() -> None:
    b = backend("a", free_tokens=2000)
    assert kv_wait_s(b, 1500) == 0.0
    assert predicted_ttft_s(b, 1000, 1500) == pytest.approx(1000 * P + STEP)


def test_a_full_cache_adds_its_turnover_to_the_predicted_first_token() -> None:
    b = backend("a", free_tokens=0)
    capacity = b.kv_total_bytes // b.kv_bytes_per_token
    # Nothing free: 1,500 tokens more than the cache holds, a 1,500 / K share of a turnover of T̄_service.
    assert kv_wait_s(b, 1500) == pytest.approx(1500 / capacity * SERVICE)
    assert predicted_ttft_s(b, 1000, 1500) == pytest.approx(1000 * P + STEP + 1500 / capacity * SERVICE)
    # This router's reservations count when they exceed what the engine last reported in use.
    reserved = replace(backend("b"), kv_reserved_tokens=capacity)
    assert predicted_ttft_s(reserved, 1000, 1500) == pytest.approx(predicted_ttft_s(b, 1000, 1500))


def test_the_soonest_first_token_goes_past_a_full_cache() -> None:
    full, free = backend("full", free_tokens=0), backend("free")
    # `free` has a prefill backlog of 2,000 tokens (0.2 s): still sooner than a turnover of a full cache.
    free = replace(free, prefill_backlog_tokens=2000)
    request = RequestProfile("r", 1000, 8000)   # 9,000 tokens of KV: 9,000 / K of a 4 s turnover on `full`
    assert kv_wait_s(full, 9000) > 0.2
    assert SoonestFirstToken().choose(request, [full, free], 0.0).backend.id == "free"
    # With room on both, the shorter queue wins.
    roomy = backend("full")
    assert SoonestFirstToken().choose(request, [roomy, free], 0.0).backend.id == "full"


def test_an_idle_backend_owes_no_decode_step_before_the_first_token() -> None:
    # A busy fast GPU (ŝ 20 ms, four in flight) and an idle one prefilling twice as slowly with a
    # longer step (30 ms): the idle one starts the prefill at once and its first token ends it.
    busy = replace(backend("busy"), queue_depth=4, in_flight=4)
    idle = replace(backend("idle"), learned_prefill_s_per_token=2 * P, decode_step_s=0.03)
    request = RequestProfile("r", 100, 16)
    assert predicted_ttft_s(idle, 100, 116) > predicted_ttft_s(busy, 100, 116)   # the pool-wide prediction
    decision = SoonestFirstToken().choose(request, [busy, idle], 0.0)
    assert decision.backend.id == "idle" and decision.costs[1].total == pytest.approx(100 * 2 * P)
    # Once it has a request of its own it owes a step as the others do.
    assert SoonestFirstToken().choose(request, [busy, replace(idle, queue_depth=1)], 0.0).backend.id == "busy"
