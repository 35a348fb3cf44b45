"""`marginal_delay` with cached prefixes: each backend priced with the tokens it would prefill, at its own speed."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gateway.routing.policies.candidates import near_lowest
from gateway.routing.policies.contracts import BackendSnapshot, RequestProfile
from gateway.routing.policies.marginal_delay import MarginalDelay, MarginalDelayParams
from gateway.routing.prefix_index import PrefixIndex
from tests.snapshots import random_cluster, snapshot


def learned(b: BackendSnapshot, prefill_s_per_token: float, step_s: float, **signals: int) -> BackendSnapshot:
    return dataclasses.replace(b, learned_prefill_s_per_token=prefill_s_per_token, decode_step_s=step_s, **signals)


H100 = learned(snapshot("h100", "H100"), 0.06e-3, 0.010)
L40S = learned(snapshot("l40s", "L40S"), 0.30e-3, 0.030)


def test_cached_tokens_leave_the_first_token_stall_and_slack_terms_only_what_is_prefilled() -> None:
    b = dataclasses.replace(H100, in_flight=5, prefill_backlog_tokens=1000, itl_slack_s=(0.05, 0.2))
    p = MarginalDelay(MarginalDelayParams(w_stall=0.2, w_itl=0.3))
    cold = p.cost(RequestProfile("r", 4000, 40), b)
    warm = p.cost(RequestProfile("r", 4000, 40, cached_tokens={"h100": 3600}), b)
    assert cold.prefill == pytest.approx((1000 + 4000) * 0.06e-3 + 0.010 + 0.2 * 5 * 4000 * 0.06e-3 + 0.3 * 2)
    # 400 tokens are a stall of 24 ms: no slack broken
    assert warm.prefill == pytest.approx((1000 + 400) * 0.06e-3 + 0.010 + 0.2 * 5 * 400 * 0.06e-3)
    assert warm.queue == cold.queue   # KV and decode: the whole request still runs there
    assert p.cost(RequestProfile("r", 4000, 40, cached_tokens={"other": 3600}), b) == cold


def test_a_hit_on_a_slow_tier_is_weighed_against_a_miss_on_a_fast_one() -> None:
    """Idle: a long shared prefix cached on the L40S saves more than the H100's faster prefill of the whole
    prompt; a short one does not."""
    p = MarginalDelay()
    long_hit = RequestProfile("r", 6000, 4, cached_tokens={"l40s": 5800})
    assert p.choose(long_hit, [H100, L40S], 0.0).backend.id == "l40s"    # 200 · 0.30 ms < 6000 · 0.06 ms
    short_hit = RequestProfile("r", 6000, 4, cached_tokens={"l40s": 1000})
    assert p.choose(short_hit, [H100, L40S], 0.0).backend.id == "h100"   # 5000 · 0.30 ms > 6000 · 0.06 ms


def test_affinity_gives_way_when_the_queue_costs_more_than_the_recomputation_saves() -> None:
    p = MarginalDelay()
    request = RequestProfile("r", 3000, 16, cached_tokens={"a": 2900})
    a, b = dataclasses.replace(H100, id="a"), dataclasses.replace(H100, id="b")
    assert p.choose(request, [a, b], 0.0).backend.id == "a"
    # 2,900 tokens saved at 0.06 ms are 0.17 s: a backlog of more than that on `a` sends it to `b`
    for backlog, chosen in ((2000, "a"), (2800, "a"), (3000, "b"), (20_000, "b")):
        busy = dataclasses.replace(a, prefill_backlog_tokens=backlog)
        assert p.choose(request, [busy, b], 0.0).backend.id == chosen, backlog


def test_a_full_cache_whose_evictions_come_back_costs_the_recomputation_it_causes() -> None:
    """T_evict = w_evict · ρ_i · L_i · p_i: the new blocks a prompt adds to a full cache push out as many,
    and a share ρ_i of those are asked for again; a hit there adds no new block and costs nothing."""
    p = MarginalDelay(MarginalDelayParams(w_evict=4.0))
    a, b = dataclasses.replace(H100, id="a"), dataclasses.replace(H100, id="b")
    request = RequestProfile("r", 2000, 16, evicted_reuse={"a": 0.5})
    costs = {c.backend_id: c for c in p.choose(request, [a, b], 0.0).costs}
    assert costs["a"].prefill - costs["b"].prefill == pytest.approx(4.0 * 0.5 * 2000 * 0.06e-3)
    assert p.choose(request, [a, b], 0.0).backend.id == "b"
    # the conversation's history is on `a`: only its 100 new tokens evict, far cheaper than 1,900 elsewhere
    returning = RequestProfile("r", 2000, 16, cached_tokens={"a": 1900}, evicted_reuse={"a": 0.5})
    assert p.choose(returning, [a, b], 0.0).backend.id == "a"
    unpriced = MarginalDelay(MarginalDelayParams(w_evict=0.0))
    assert unpriced.cost(request, a) == unpriced.cost(RequestProfile("r", 2000, 16), a)


@pytest.mark.parametrize(("seed", "n"), [(seed, n) for seed in range(4) for n in (3, 40)])
def test_columns_and_the_one_candidate_form_agree_with_cached_tokens(seed: int, n: int) -> None:
    rng = random.Random(seed)
    snapshots = [dataclasses.replace(
        b, in_flight=rng.randint(0, 40), prefill_backlog_tokens=rng.randint(0, 8_000),
        decode_step_s=rng.choice([0.0, 0.02, 0.05]), learned_prefill_s_per_token=rng.choice([0.0, 1e-4, 3e-4]),
        itl_slack_s=tuple(sorted(rng.choice([0.0, 0.05, 0.3, 2.0]) for _ in range(rng.randint(0, 3)))),
    ) for b in random_cluster(rng, n)]
    for length in (16, 1_500, 3_000):
        cached = {b.id: rng.randint(0, length - 1) for b in snapshots if rng.random() < 0.5}
        reuse = {b.id: rng.random() for b in snapshots if rng.random() < 0.3}
        request = RequestProfile("r", length, 64, cached_tokens=cached, evicted_reuse=reuse)
        policy = MarginalDelay(rng=random.Random(7))   # the draw among near ties: the same as below
        decision = policy.choose(request, snapshots, now=0.0)
        expected = [policy.cost(request, b) for b in snapshots]
        assert list(decision.costs) == expected
        best = near_lowest([c.total for c in expected], random.Random(7), MarginalDelayParams().tie_tolerance)
        assert decision.backend is snapshots[best]


def test_a_backend_priced_out_by_its_evictions_takes_new_prompts_again_once_the_cluster_moved_on() -> None:
    """The index and the policy together: `a`, the faster, has a full cache whose evicted blocks came back
    elsewhere (ρ_a high), so new prompts go to `b`; none of them goes to `a`, so `a` evicts nothing, and
    without ageing its ρ_a would price it out for good. It ages with the blocks `b` takes in, and `a`
    takes new prompts again."""
    index = PrefixIndex(16)
    index.add_backend("a", 40 * 16)
    index.add_backend("b", 10_000 * 16)
    policy = MarginalDelay()
    a = dataclasses.replace(H100, id="a")
    b = dataclasses.replace(H100, id="b", learned_prefill_s_per_token=0.08e-3)

    def prompt(tag: str) -> list[int]:   # 12 blocks of text of its own, 200 tokens
        return index.hashes("".join(f"{tag}-{j}".ljust(64, "-") for j in range(12)), (), 200)

    old = [prompt(f"old{k}") for k in range(8)]
    for blocks in old:   # a full and turning over
        index.record(index.lookup(blocks, "", 200), "a", 40 * 16)
    for blocks in old[:4]:   # what it evicted is asked for again, elsewhere
        index.record(index.lookup(blocks, "", 200), "b", 10_000 * 16)
    chosen = []
    for k in range(40):
        query = index.lookup(prompt(f"new{k}"), "", 200)
        profile = RequestProfile(f"r{k}", 200, 16, cached_tokens=query.cached, evicted_reuse=query.reuse)
        chosen.append(policy.choose(profile, [a, b], 0.0).backend.id)
        index.record(query, chosen[-1], (40 if chosen[-1] == "a" else 10_000) * 16)
    assert chosen[:5] == ["b"] * 5   # T_evict on a: 16 · ρ_a · 200 · 0.06 ms, above b's slower prefill
    assert "a" in chosen[5:]
