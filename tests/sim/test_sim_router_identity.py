"""The simulator routes with the gateway's own policy objects and snapshot type, not copies."""

from __future__ import annotations

import pytest

import gateway.routing.policies as policies
from common.catalog import load_catalog
from gateway.routing.backend_entry import Lease
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile
from gateway.routing.policies.heteroserve import HeteroServe
from gateway.routing.state_table import StateTable
from loadtest.sim import simulator
from loadtest.sim.engines import Recorder
from loadtest.sim.experiments import THREE_TIER
from loadtest.sim.simulator import RunSpec, build_engines, make_policy, run
from loadtest.sim.workloads import make_trace


def test_policies_come_from_the_gateway_registry() -> None:
    assert simulator.build_policy is policies.build_policy
    for name, cls in policies.REGISTRY.items():
        if name in ("encode_cost", "least_image_tokens"):
            continue
        assert type(make_policy(RunSpec(THREE_TIER, name))) is cls


def test_every_arrival_calls_the_gateway_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[RequestProfile, int]] = []
    original = HeteroServe.choose

    def spy(self: HeteroServe, request: RequestProfile, candidates: list[BackendSnapshot], now: float) -> Decision:
        assert all(type(c) is BackendSnapshot for c in candidates)
        calls.append((request, len(candidates)))
        return original(self, request, candidates, now)

    monkeypatch.setattr(HeteroServe, "choose", spy)
    run(RunSpec(THREE_TIER, "heteroserve", mode="continuous", n_requests=200))
    assert len(calls) == 200 and all(n == len(THREE_TIER) for _, n in calls)


def test_snapshots_carry_engine_signals() -> None:
    catalog = load_catalog()
    spec = RunSpec(THREE_TIER, "round_robin", mode="continuous", n_requests=50)
    trace = make_trace(spec.workload, spec.arrivals, 1.0, spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_engines(spec, catalog, rec)
    h100 = engines[0]
    idle = h100.snapshot()
    assert idle.queue_depth == 0 and idle.kv_free_bytes == idle.kv_total_bytes
    h100.submit(0, 0.0)
    busy = h100.snapshot()
    assert busy.queue_depth == 1 and busy.in_flight == 1 and busy.kv_free_bytes < busy.kv_total_bytes
    params, flops = catalog.model("llama-2-70b").params, catalog.gpu("H100").flops
    assert busy.prefill_s_per_token == pytest.approx(2 * params / flops)


def test_leases_and_snapshots_are_the_gateway_state_tables() -> None:
    """One state core: the engines of a run report to one live `StateTable`, which holds their leases
    and builds the snapshots the policy reads."""
    catalog = load_catalog()
    spec = RunSpec(THREE_TIER, "marginal_delay", mode="continuous", n_requests=10)
    trace = make_trace(spec.workload, spec.arrivals, 1.0, spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_engines(spec, catalog, rec)
    table = engines[0].gateway.table
    assert type(table) is StateTable and all(e.gateway.table is table for e in engines)
    engines[1].submit(0, 0.0)
    entry = table.get(engines[1].id)
    assert entry is not None and entry.in_flight == 1 and entry.prefill_backlog_tokens == trace.lengths.input_tokens[0]
    assert all(type(lease) is Lease for lease in engines[1]._leases.values())
    assert engines[1].snapshot() is table.snapshot(entry)
