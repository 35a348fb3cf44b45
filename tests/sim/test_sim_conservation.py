"""Every request is routed once and completes exactly once; engines end empty; KV never overflows."""

from __future__ import annotations

import numpy as np
import pytest

from backends.batcher import ContinuousBatcher, StepResult
from common.catalog import load_catalog
from loadtest.sim.engines import BatchEngine, Recorder
from loadtest.sim.experiments import THREE_TIER
from loadtest.sim.simulator import RunSpec, arrival_rate, build_engines, make_policy, simulate
from loadtest.sim.workloads import make_trace

POLICIES = ["round_robin", "shortest_queue", "power_of_two", "capacity_proportional", "heteroserve", "batch_aware",
            "marginal_delay"]


def _simulate(spec: RunSpec) -> tuple[Recorder, list]:
    catalog = load_catalog()
    trace = make_trace(spec.workload, spec.arrivals, arrival_rate(spec, catalog), spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_engines(spec, catalog, rec)
    simulate(trace, engines, make_policy(spec), rec)
    return rec, engines


@pytest.mark.parametrize("mode", ["serial", "continuous"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_exactly_once(mode: str, policy: str) -> None:
    spec = RunSpec(THREE_TIER, policy, mode=mode, n_requests=300, seed=3, load=1.5)
    rec, engines = _simulate(spec)
    assert (rec.backend >= 0).all()                       # routed once, to a real engine
    assert not rec.rejected.any()
    assert not np.isnan(rec.finish).any()                 # everyone finished
    assert (rec.first_token <= rec.finish).all()
    assert (rec.admitted <= rec.first_token).all()
    assert sum(e.entry.in_flight for e in engines) == 0   # nothing left in flight
    assert all(e.queue_depth() == 0 for e in engines)
    per_engine = np.bincount(rec.backend, minlength=len(engines))
    assert per_engine.sum() == spec.n_requests
    # the router's own leases are all returned, and every engine that served requests learned its speed
    assert all(e.entry.prefilling == e.entry.prefill_backlog_tokens == e.entry.kv_reserved_tokens == 0 for e in engines)
    assert all(e.entry.speed.service_samples == n for e, n in zip(engines, per_engine, strict=True))


def test_kv_never_exceeds_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overload a continuous-batching cluster with long prompts and check the cache after every step."""
    seen: list[tuple[int, int]] = []
    original = ContinuousBatcher.step

    def checked(self: ContinuousBatcher) -> StepResult:
        result = original(self)
        seen.append((self.kv_used_bytes, self.kv_capacity_bytes))
        assert 0 <= self.kv_used_bytes <= self.kv_capacity_bytes
        return result

    monkeypatch.setattr(ContinuousBatcher, "step", checked)
    spec = RunSpec(THREE_TIER, "round_robin", mode="continuous", workload="long_heavy", n_requests=400, load=2.0)
    rec, engines = _simulate(spec)
    assert seen and max(used / cap for used, cap in seen) > 0.8    # the cache really was under pressure
    assert all(isinstance(e, BatchEngine) and e.batcher.kv_used_bytes == 0 for e in engines)
    assert not np.isnan(rec.finish).any()
