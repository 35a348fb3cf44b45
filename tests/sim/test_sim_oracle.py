"""The clairvoyant oracle: conserves requests, is deterministic, and its choice is the brute-force optimum.

Brute force here means: copy the engine, submit the request to the copy and let the copy's own
events run until that request completes; the oracle's chosen GPU must have the earliest such time.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest

from common import perf_model
from common.catalog import load_catalog
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile
from loadtest.sim import oracle
from loadtest.sim.engines import BatchEngine, Engine, EngineSpec, Recorder, SerialEngine
from loadtest.sim.experiments import THREE_TIER
from loadtest.sim.simulator import RunSpec, arrival_rate, build_engines, make_policy, run, simulate
from loadtest.sim.workloads import make_trace

MODES = ["serial", "continuous"]
TIMING = {"wall_s", "cpu_s"}


def _setup(spec: RunSpec) -> tuple[np.ndarray, Recorder, list[Engine], oracle.Oracle]:
    catalog = load_catalog()
    trace = make_trace(spec.workload, spec.arrivals, arrival_rate(spec, catalog), spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_engines(spec, catalog, rec)
    policy = make_policy(spec, engines)
    assert isinstance(policy, oracle.Oracle)
    simulate(trace, engines, policy, rec)
    return trace.arrival_s, rec, engines, policy


@pytest.mark.parametrize("mode", MODES)
def test_every_request_is_routed_once_and_completes(mode: str) -> None:
    spec = RunSpec(THREE_TIER, oracle.NAME, mode=mode, n_requests=400, seed=5, load=1.5)
    _, rec, engines, policy = _setup(spec)
    assert (rec.backend >= 0).all() and not rec.rejected.any()
    assert not np.isnan(rec.finish).any()
    assert (rec.admitted <= rec.first_token).all() and (rec.first_token <= rec.finish).all()
    assert sum(e.entry.in_flight for e in engines) == 0 and all(e.queue_depth() == 0 for e in engines)
    assert np.bincount(rec.backend, minlength=len(engines)).sum() == spec.n_requests
    assert sorted(policy.predicted) == list(range(spec.n_requests))
    assert len(set(rec.backend.tolist())) > 3          # it spreads load, not one GPU for everything


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_result(mode: str) -> None:
    def metrics(seed: int) -> dict[str, float]:
        out = run(RunSpec(THREE_TIER, oracle.NAME, mode=mode, n_requests=300, seed=seed))
        return {k: v for k, v in out.items() if k not in TIMING}

    assert metrics(7) == metrics(7)
    assert metrics(7)["throughput_tok_s"] != metrics(8)["throughput_tok_s"]


def test_serial_predictions_are_exact_for_every_request() -> None:
    """FIFO serial GPUs: no later arrival can delay a routed request, so predicted = realized, bit for bit."""
    arrival, rec, _, policy = _setup(RunSpec(THREE_TIER, oracle.NAME, n_requests=400, seed=2, load=1.5))
    predicted = np.array([policy.predicted[i] for i in range(len(arrival))])
    assert np.array_equal(predicted, rec.finish)
    assert policy.realized_over_predicted(arrival, rec.finish) == 1.0


def _pending_event(engine: Engine) -> float | None:
    """The time of the engine's next event, as the simulator's heap holds it."""
    if isinstance(engine, SerialEngine):
        return engine.finish_s(float(engine.rec.admitted[engine.current]), engine.current) if engine.current >= 0 \
            else None
    assert isinstance(engine, BatchEngine)
    return engine.step_end_s if engine.stepping else None


def _brute_force_finish(engine: Engine, i: int, now: float) -> float:
    """Submit request i to a copy of the engine and run the copy's own events until i completes."""
    twin = copy.deepcopy(engine)
    started = twin.submit(i, now)
    t = _pending_event(engine) if started is None else started
    while np.isnan(twin.rec.finish[i]):
        assert t is not None
        _, t = twin.on_event(t)
    return float(twin.rec.finish[i])


@pytest.mark.parametrize("mode", MODES)
def test_chosen_gpu_minimises_the_brute_force_completion_time(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[list[float], Decision, float]] = []
    original = oracle.Oracle.choose

    def checked(self: oracle.Oracle, request: RequestProfile, candidates: Sequence[BackendSnapshot],
                now: float) -> Decision:
        i = int(request.request_id)
        brute = [_brute_force_finish(self.engines[b.id], i, now) for b in candidates] if i % 15 == 14 else []
        decision = original(self, request, candidates, now)
        if brute:
            seen.append((brute, decision, now))
        return decision

    monkeypatch.setattr(oracle.Oracle, "choose", checked)
    _setup(RunSpec(THREE_TIER, oracle.NAME, mode=mode, n_requests=450, seed=4, load=1.5))
    assert len(seen) == 30
    spread = []
    for brute, decision, now in seen:
        ids = [c.backend_id for c in decision.costs]
        chosen = brute[ids.index(decision.backend.id)]
        assert chosen == pytest.approx(min(brute), rel=1e-12)
        assert decision.cost + now == pytest.approx(chosen, rel=1e-12)
        predicted = [c.total + now for c in decision.costs]
        if mode == "serial":                        # exact for every candidate
            assert predicted == pytest.approx(brute, rel=1e-12)
        else:                                        # exact where replayed to the end, else a lower bound
            assert all(p <= b * (1 + 1e-12) for p, b in zip(predicted, brute, strict=True))
        spread.append(max(brute) / min(brute))
    assert max(spread) > 1.2                         # the GPUs really differed: the choice mattered


@pytest.mark.parametrize("max_batch,kv_tokens", [(4, 10**6), (256, 6_000)])
def test_replay_matches_the_batcher_when_the_batch_cap_or_the_cache_binds(max_batch: int, kv_tokens: int) -> None:
    catalog = load_catalog()
    model, gpu = catalog.model("llama-2-7b"), catalog.gpu("L40S")
    trace = make_trace("sharegpt", "poisson", 40.0, 40, seed=1)
    rec = Recorder.for_lengths(trace.lengths)
    spec = EngineSpec("g", model, gpu, kv_tokens * model.kv_bytes_per_token, 1.0, max_batch=max_batch)
    engine = BatchEngine(spec, rec)
    arrivals = trace.arrival_s.tolist()
    t: float | None = None
    for i, now in enumerate(arrivals):
        while t is not None and t <= now:
            _, t = engine.on_event(t)
        if i == len(arrivals) - 1:
            break
        started = engine.submit(i, now)
        t = started if started is not None else t
    assert engine.batcher.waiting and engine.stepping             # a queue formed behind the binding limit
    last = len(arrivals) - 1
    replayed = oracle.batch_finish_s(engine, oracle.Roofline.of(model, gpu), last, arrivals[last])
    assert replayed == pytest.approx(_brute_force_finish(engine, last, arrivals[last]), rel=1e-12)


@pytest.mark.parametrize("model,gpu,batch,context", [
    ("llama-2-70b", "H100", 100, 90_000),            # memory-bound throughout
    ("llama-2-7b", "A100-80GB", 240, 2_000),         # compute-bound first, then memory-bound
    ("llama-2-7b", "H100", 256, 0),                  # compute-bound throughout
])
def test_closed_form_decode_run_equals_the_step_by_step_sum(model: str, gpu: str, batch: int, context: int) -> None:
    catalog = load_catalog()
    m, g = catalog.model(model), catalog.gpu(gpu)
    roof = oracle.Roofline.of(m, g)
    for steps in (1, 7, 300):
        expected = sum(perf_model.decode_step_seconds(m, g, batch, context + j * batch) for j in range(steps))
        assert roof.decode_run_s(batch, context, steps) == pytest.approx(expected, rel=1e-12)


def test_refuses_engines_it_cannot_replay() -> None:
    catalog = load_catalog()
    model, gpu = catalog.model("llama-2-7b"), catalog.gpu("RTX-4090")
    rec = Recorder.for_lengths(make_trace("sharegpt", "poisson", 1.0, 4, 0).lengths)
    bounded = BatchEngine(EngineSpec("v", model, gpu, 10**9, 1.0, max_prefill_tokens=512), rec)
    with pytest.raises(ValueError, match="prefill bound"):
        oracle.Oracle([bounded])
    with pytest.raises(ValueError, match="engines"):
        oracle.Oracle([])
