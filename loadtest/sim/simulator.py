"""The event loop: arrivals → the gateway's router → simulated GPUs, in virtual time.

Every arrival builds a `RequestProfile`, takes the candidates from the gateway's own `StateTable`
(engines.GatewayState) and asks the policy object from `gateway.routing.policies.build_policy` to
choose, exactly as the live gateway does; the chosen engine is leased at once (the paper's feedback
loop). Engines report their next event time; a heap merges them with the arrival stream. Signals are
exact and fresh here (no heartbeat lag).
The one policy that is not the gateway's, `oracle` (oracle.py), reads the engines instead of snapshots.

With an overload queue (`gateway.pipeline.overload.OverloadQueue`, the live gateway's), an arrival
whose predicted first token is late on every backend is held, or refused (marked rejected), as the
live gateway decides; held requests are released, earliest start deadline first, after each engine
event (a first token or a completion moves the predictions), refused at their start deadline, and
routed when released; a request it lets go, at once or released, is sent to a backend that takes it
(`OverloadQueue.route`), as the live gateway sends it.

`RunSpec.prefix_cache`: "engines" gives the continuous-batching engines the simulated engines' prefix
cache (engines.py) on the trace's blocks; "index" also routes as the gateway does with cache-aware
routing on: its prefix index (`gateway.routing.prefix_index`) predicts each backend's cached prefix,
the policy reads it as `RequestProfile.cached_tokens`, the lease counts the rest as prefill, and the
engines' reported counters correct the index. The run then reports the engines' `prefix_hit_rate`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from common import perf_model
from common.catalog import Catalog, load_catalog
from gateway.config.sections import OverloadConfig
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import Policy, RequestProfile, Role
from gateway.routing.prefix_index import PrefixIndex, PrefixQuery
from loadtest.sim import capacity, oracle
from loadtest.sim.engines import BatchEngine, Engine, EngineSpec, GatewayState, Recorder, SerialEngine
from loadtest.sim.gate import SimGate
from loadtest.sim.metrics import summarize
from loadtest.sim.workloads import Trace, make_trace, mean_lengths

MODES = ("serial", "continuous")
PREFIX_CACHE = ("off", "engines", "index")
LANGUAGE_ROLES: tuple[Role, ...] = ("language", "both")   # the language pool, as gateway/pipeline/dispatch.py has it


@dataclass(frozen=True)
class RunSpec:
    gpus: tuple[str, ...]                  # catalog GPU names, one per backend
    policy: str
    params: tuple[tuple[str, Any], ...] = ()   # policy parameters, hashable so equal runs dedupe
    model: str = "llama-2-70b"
    mode: str = "serial"
    workload: str = "sharegpt"
    arrivals: str = "poisson"
    load: float = 1.0                      # × Σ_i μ_i (see capacity.py)
    n_requests: int = 2000
    seed: int = 0
    prefix_cache: str = "off"              # "off", "engines" (they cache), "index" (and the gateway's index routes)


def arrival_rate(spec: RunSpec, catalog: Catalog) -> float:
    """spec.load · Σ_i μ_i (capacity.py)."""
    model = catalog.model(spec.model)
    return spec.load * sum(capacity.service_rate(model, catalog.gpu(g), spec.mode, spec.workload) for g in spec.gpus)


def build_engines(spec: RunSpec, catalog: Catalog, rec: Recorder) -> list[Engine]:
    model = catalog.model(spec.model)
    prompt, output, _ = mean_lengths(spec.workload)
    engines: list[Engine] = []
    gateway = GatewayState(model)
    counts: dict[str, int] = {}
    for name in spec.gpus:
        gpu = catalog.gpu(name)
        k = counts[name] = counts.get(name, -1) + 1
        if spec.mode == "serial":
            prior = capacity.serial_service_s(model, gpu, prompt, output)
        else:
            prior = perf_model.service_seconds(model, gpu, round(prompt), round(output))
        es = EngineSpec(f"{name.lower()}-{k}", model, gpu, capacity.kv_capacity(model, gpu), prior,
                        prefix_caching=spec.prefix_cache != "off")
        engines.append(SerialEngine(es, rec, gateway) if spec.mode == "serial" else BatchEngine(es, rec, gateway))
    return engines


def make_policy(spec: RunSpec, engines: Sequence[Engine] = ()) -> Policy:
    """The gateway's policy by name; the simulator-only `oracle` reads the engines it routes to."""
    if spec.policy == oracle.NAME:
        return oracle.Oracle(engines)
    params = dict(spec.params)
    if spec.policy == "power_of_two":
        params.setdefault("seed", spec.seed)
    return build_policy(spec.policy, params)


def simulate(trace: Trace, engines: list[Engine], policy: Policy, rec: Recorder,
             overload: OverloadConfig | None = None, prefixes: PrefixIndex | None = None) -> int:
    """Run `trace` to completion; returns the number of engine events processed. `overload`: the
    gateway's overload queue with these settings, on the virtual clock (requests it refuses are marked
    rejected; loadtest/sim/gate.py); `prefixes`: the gateway's prefix index, routing as the gateway does
    with cache-aware routing on."""
    index = {e.id: k for k, e in enumerate(engines)}
    gateway = engines[0].gateway
    if any(e.gateway is not gateway for e in engines):
        raise ValueError("the engines of one simulation must share one GatewayState (one gateway routes them all)")
    lengths = trace.lengths
    inputs, max_out, images = lengths.input_tokens.tolist(), lengths.max_output_tokens.tolist(), lengths.image_tokens
    heap: list[tuple[float, int]] = []
    events = 0
    queries: dict[int, PrefixQuery] = {}   # the prefix index's view of a request's prompt, from arrival to dispatch

    def dispatch(i: int, profile: RequestProfile, now: float) -> None:
        candidates = gateway.refresh(now).candidates(LANGUAGE_ROLES, now)
        if gate is None:
            decision = policy.choose(profile, candidates, now)
        else:   # to a backend that takes it, as the live gateway routes (OverloadQueue.route)
            decision = gate.route(lambda within: policy.choose(profile, within, now), candidates, profile)
        k = index[decision.backend.id]
        rec.backend[i] = k
        cached = 0
        if prefixes is not None and (query := queries.pop(i, None)) is not None:
            engine = engines[k]
            prefixes.observe(engine.id, *engine.prefix_counters())
            prefixes.record(query, engine.id, engine.kv_capacity // engine.model.kv_bytes_per_token)
            cached = query.cached.get(engine.id, 0)
        t = engines[k].submit(i, now, cached)
        if t is not None:
            heapq.heappush(heap, (t, k))

    def refused(i: int) -> None:
        rec.rejected[i] = True
        queries.pop(i, None)

    gate = None if overload is None else SimGate(
        overload, lambda now: gateway.refresh(now).candidates(LANGUAGE_ROLES, now), dispatch, refused)

    def fire() -> None:
        now, k = heapq.heappop(heap)
        done, nxt = engines[k].on_event(now)
        if nxt is not None:
            heapq.heappush(heap, (nxt, k))
        if gate is not None:
            gate.engine_event(now, len(done))

    for i, now in enumerate(trace.arrival_s.tolist()):
        while heap and heap[0][0] <= now:
            fire()
            events += 1
        profile = RequestProfile(str(i), inputs[i], max_out[i], int(images[i]))
        if prefixes is not None:
            query = queries[i] = prefixes.lookup(lengths.blocks(i, prefixes.block_tokens), "", inputs[i])
            if query.cached or query.reuse:
                profile = replace(profile, cached_tokens=query.cached, evicted_reuse=query.reuse)
        if gate is None or gate.arrive(i, profile, now):
            dispatch(i, profile, now)
    while heap or (gate is not None and gate.held):
        if not heap:   # held with nothing running: nothing will free capacity, so each waits out its deadline
            assert gate is not None
            gate.release(gate.next_due())
            continue
        fire()
        events += 1
    return events


def run(spec: RunSpec, catalog: Catalog | None = None, rate: float | None = None) -> dict[str, Any]:
    """One simulation; `rate` (requests/s) overrides spec.load · Σ μ_i when the caller already knows it."""
    catalog = catalog or load_catalog()
    if spec.mode not in MODES:
        raise ValueError(f"unknown engine mode {spec.mode!r}; known: {MODES}")
    started, cpu = time.perf_counter(), time.process_time()
    rate = arrival_rate(spec, catalog) if rate is None else rate
    trace = make_trace(spec.workload, spec.arrivals, rate, spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_engines(spec, catalog, rec)
    policy = make_policy(spec, engines)
    if spec.prefix_cache not in PREFIX_CACHE or (spec.prefix_cache != "off" and spec.mode != "continuous"):
        raise ValueError(f"prefix_cache {spec.prefix_cache!r}: one of off, engines, index (continuous mode only)")
    prefixes = None
    if spec.prefix_cache == "index":
        prefixes = PrefixIndex()
        for e in engines:
            prefixes.add_backend(e.id, e.kv_capacity // e.model.kv_bytes_per_token)
    events = simulate(trace, engines, policy, rec, prefixes=prefixes)
    gpu_names = np.array([e.gpu.name for e in engines])
    out = summarize(trace, rec, gpu_names, [e.gpu.price_per_hour for e in engines])
    if isinstance(policy, oracle.Oracle):
        out["oracle_realized_over_predicted"] = policy.realized_over_predicted(trace.arrival_s, rec.finish)
    if spec.prefix_cache != "off":
        queries, hits = (sum(c) for c in zip(*(e.prefix_counters() for e in engines), strict=True))
        out["prefix_hit_rate"] = hits / queries if queries else 0.0
    out.update(events=events, wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu, rate_rps=rate)
    return out
