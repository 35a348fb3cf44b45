"""The engine family (loadtest/sim/family.py): its members, and engines that do what they say."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.catalog import load_catalog
from gateway.config.sections import OverloadConfig
from gateway.routing.policies import build_policy
from loadtest.sim import family as F
from loadtest.sim.engines import GatewayState, Recorder
from loadtest.sim.simulator import simulate
from loadtest.sim.workloads import Lengths, Trace


def test_the_family_spans_what_engines_vary_and_keeps_members_out_of_tuning() -> None:
    members = F.family()
    assert len(members) >= 12
    assert [m.name for m in members if m.held_out] == ["m03", "m07", "m11", "m15"]
    assert {m.engine.scheduling for m in members} == {"chunked", "prefill_first"}
    assert {m.engine.kv_allocation for m in members} == {"reserve", "paged"}
    assert min(m.prefill_ratio for m in members) == pytest.approx(2.0)
    assert max(m.prefill_ratio for m in members) == pytest.approx(6.0)
    assert len({m.engine.max_batched_tokens for m in members}) >= 4
    assert len({m.engine.noise_sigma for m in members}) >= 3 and len({m.engine.max_num_seqs for m in members}) >= 3
    assert all(2 <= len(m.tiers) <= 3 and 6 <= sum(m.counts) <= 10 for m in members)
    assert F.family() == members   # seeded: the same family every time


def _one_engine(model: F.EngineModel, tier: F.TierModel, prompts: list[int], outputs: list[int],
                arrivals: list[float]) -> Recorder:
    catalog = load_catalog()
    n = len(prompts)
    zeros = np.zeros(n, dtype=np.int64)
    lengths = Lengths(np.array(prompts), zeros, zeros, np.array(outputs), np.array(outputs))
    member = F.Member("t", model, (tier,), (1,), False, 1.0, 1.0)
    rec = Recorder.for_lengths(lengths)
    gateway = GatewayState(catalog.model(F.MODEL))
    engines = F.build(member, rec, gateway, 0, catalog)
    simulate(Trace(np.array(arrivals), lengths), engines, build_policy("least_outstanding"), rec)
    return rec


TIER = F.TierModel("H100", 0.010, 0.0001, 2e-8, 0.0001, 60_000)


@pytest.mark.parametrize("scheduling", ["chunked", "prefill_first"])
@pytest.mark.parametrize("kv", ["reserve", "paged"])
def test_every_request_completes_with_its_tokens(scheduling: F.Scheduling, kv: F.KvAllocation) -> None:
    model = F.EngineModel(scheduling, 16, 512 if scheduling == "chunked" else 4096, kv, 0.1)
    rng = np.random.default_rng(1)
    n = 200
    rec = _one_engine(model, dataclasses.replace(TIER, kv_tokens=8_000), rng.integers(16, 3000, n).tolist(),
                      rng.integers(2, 200, n).tolist(), np.sort(rng.uniform(0, 10, n)).tolist())
    assert not np.isnan(rec.finish).any() and not rec.rejected.any()
    assert (rec.first_token <= rec.finish).all() and (rec.admitted <= rec.first_token).all()


def test_a_paged_cache_preempts_and_recomputes_when_it_runs_out() -> None:
    model = F.EngineModel("chunked", 64, 512, "paged", 0.0)
    batcher = F.FamilyBatcher(dataclasses.replace(TIER, kv_tokens=4_000), model, np.random.default_rng(0))
    seqs = [F.FamilySeq(k, 1000, 1000, 1000) for k in range(3)]
    batcher.waiting.extend(seqs)
    while not batcher.idle:
        step = batcher.step()
        assert step is not None and batcher.free_blocks >= 0
    assert batcher.preemptions > 0
    assert all(s.generated == 1000 for s in seqs)
    assert batcher.free_blocks == batcher.total_blocks


def test_prefill_first_stalls_decodes_and_chunked_prefill_does_not() -> None:
    """A 3,000-token prompt arriving while a request decodes: prefill-first runs it as one step in
    which nobody decodes; chunked prefill decodes in every step beside its chunks."""
    def longest_gap(scheduling: F.Scheduling) -> float:
        model = F.EngineModel(scheduling, 64, 512 if scheduling == "chunked" else 8192, "reserve", 0.0)
        rec = _one_engine(model, TIER, [100, 3000], [200, 2], [0.0, 0.5])
        return float(rec.finish[0] - rec.first_token[0]) / 199
    assert longest_gap("prefill_first") > longest_gap("chunked")


def test_a_run_scores_goodput_on_the_scored_requests_only() -> None:
    member = F.family()[4]
    settings = F.RunSettings(requests=60, warmup=20)
    trace, first = F.trace_for(member, 0.5, 1, settings)
    assert first == 20 and trace.n == 80
    assert (np.diff(trace.arrival_s) >= 0).all() and trace.arrival_s[20] - trace.arrival_s[19] >= F.WARMUP_GAP_S
    out = F.run(member, build_policy("least_outstanding"), 0.5, 1, settings)
    assert 0.0 <= out["goodput"] <= 1.0 and out["rejected"] == 0
    assert sum(out["tier_shares"].values()) == pytest.approx(1.0)
    assert F.run(member, build_policy("least_outstanding"), 0.5, 1, settings) == out   # seeded


def test_the_overload_queue_in_the_simulator_serves_or_refuses_every_request_once() -> None:
    """Past capacity the gateway's own overload queue holds and refuses requests in virtual time: each
    request either completes with its tokens or is refused before it reaches any engine; well below
    capacity none is refused and the run is the same as without the queue."""
    member = F.family()[0]
    settings = F.RunSettings(requests=300, warmup=50)
    catalog = load_catalog()
    config = OverloadConfig(enabled=True, protect_itl=True)
    trace, _ = F.trace_for(member, 1.5, 1, settings)
    rec = Recorder.for_lengths(trace.lengths)
    gateway = GatewayState(catalog.model(F.MODEL), settings.report_interval_s)
    simulate(trace, F.build(member, rec, gateway, 1, catalog), build_policy("marginal_delay"), rec, config)
    refused, done = rec.rejected, ~np.isnan(rec.finish)
    assert refused.any() and done.any()
    assert (refused ^ done).all()                      # each one, exactly once
    assert (rec.backend[refused] == -1).all()          # refused ones never reached an engine
    assert (rec.first_token[done] >= trace.arrival_s[done]).all()
    assert all(e.in_flight == 0 for e in gateway.table.entries())   # nothing left leased
    calm = F.run(member, build_policy("marginal_delay"), 0.3, 1, settings, catalog, config)
    assert calm["rejected"] == 0
    assert calm == F.run(member, build_policy("marginal_delay"), 0.3, 1, settings, catalog)
