"""Modality-level disaggregation in virtual time (modality paper §5-§6): monolithic vs split, ± stealing.

The dispatch mirrors gateway/pipeline/dispatch.py: the language backend is chosen first (language pool, plus
the vision GPUs that `gateway.routing.policies.stealing.stealers` admits), and counted in flight at once;
an image request is then encoded on the vision backend chosen by the vision policy (`encode_cost`)
and its embedding (perf_model.embedding_bytes) travels over PCIe to the language backend; a
monolithic (`both`) GPU encodes its own images and moves nothing. Text-only requests skip vision.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.scheduling import stealing_limits
from common import perf_model
from common.catalog import Catalog, GpuProfile, ModelProfile, load_catalog
from gateway.config.sections import OverloadConfig
from gateway.routing.policies import build_policy
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import Policy, RequestProfile, Role
from gateway.routing.policies.stealing import DEFAULT_THRESHOLD, stealers
from loadtest.sim import capacity
from loadtest.sim.engines import EngineSpec, GatewayState, Recorder
from loadtest.sim.gate import SimGate
from loadtest.sim.metrics import summarize
from loadtest.sim.simulator import LANGUAGE_ROLES
from loadtest.sim.vlm import ENGINE_DEFAULTS, STEAL_EPISODE_S, Delivery, EncodeJob, VlmEngine
from loadtest.sim.workloads import Trace, make_trace, mean_lengths

PCIE_BYTES_S = 25e9     # PCIe Gen4 x16, effective: a 4.7 MB LLaVA embedding moves in ≈ 0.2 ms
VISION_ROLES: tuple[Role, ...] = ("vision",)   # the encoders a request's images may go to (as the gateway's)

Member = tuple[str, Role, bool]      # (catalog GPU, role, steal)
DEPLOYMENTS: dict[str, tuple[Member, ...]] = {
    "4×A100 monolithic": (("A100-80GB", "both", False),) * 4,
    "2×4090 vision + 2×A100": (("RTX-4090", "vision", False),) * 2 + (("A100-80GB", "language", False),) * 2,
    "2×4090 vision + 2×A100 + stealing": (("RTX-4090", "vision", True),) * 2
    + (("A100-80GB", "language", False),) * 2,
}


@dataclass(frozen=True)
class VlmRunSpec:
    deployment: str
    rate: float                         # requests/s
    n_requests: int = 3000
    seed: int = 0
    workload: str = "coco"
    model: str = "llava-1.5-7b"
    policy: str = "heteroserve"         # language pool (the gateway's default)
    vision_policy: str = "encode_cost"  # vision pool (the gateway's default)
    steal_threshold: int = DEFAULT_THRESHOLD


def a100_rate(catalog: Catalog, model: str = "llava-1.5-7b", workload: str = "coco") -> float:
    """Measured saturated request rate of one A100 language engine: the unit the loads are set in."""
    return capacity.measured_batch_rate(catalog.model(model), catalog.gpu("A100-80GB"), workload)


def build(spec: VlmRunSpec, catalog: Catalog, rec: Recorder) -> list[VlmEngine]:
    model = catalog.model(spec.model)
    prompt, output, _ = mean_lengths(spec.workload)
    return build_members(DEPLOYMENTS[spec.deployment], model, catalog, rec,
                         lambda gpu: perf_model.service_seconds(model, gpu, round(prompt), round(output)))


def build_members(
    members: Sequence[Member], model: ModelProfile, catalog: Catalog, rec: Recorder,
    prior_s: Callable[[GpuProfile], float], engine: type[VlmEngine] = VlmEngine,
) -> list[VlmEngine]:
    """The engines of any deployment (one GatewayState), each T̄_service starting at `prior_s(gpu)`:
    what `build` does for a named one, and what a planner needs for the deployments it searches."""
    gateway = GatewayState(model)
    return [build_member(f"{name.lower()}-{k}", k, name, role, steal, model, catalog, rec, prior_s, gateway, engine)
            for k, (name, role, steal) in enumerate(members)]


def build_member(
    backend_id: str, index: int, gpu_name: str, role: Role, steal: bool, model: ModelProfile, catalog: Catalog,
    rec: Recorder, prior_s: Callable[[GpuProfile], float], gateway: GatewayState,
    engine: type[VlmEngine] = VlmEngine,
) -> VlmEngine:
    """One engine of a deployment, registered in `gateway` (a pool that grows adds them one at a time)."""
    gpu = catalog.gpu(gpu_name)
    decoder = role != "vision" or steal
    kv = capacity.kv_capacity(model, gpu, encoder_loaded=role != "language") if decoder else 0
    max_batch, max_prefill = ENGINE_DEFAULTS.max_batch, None
    if role == "vision":   # a stealing GPU: half batch, per-step prefill within the episode bound
        max_batch, max_prefill = stealing_limits(max_batch, STEAL_EPISODE_S,
                                                 perf_model.prefill_seconds_per_token(model, gpu))
    es = EngineSpec(backend_id, model, gpu, kv, prior_s(gpu), role=role, steal=steal,
                    max_batch=max_batch, max_prefill_tokens=max_prefill)
    return engine(es, rec, index, gateway)


class VlmSimulation:
    """One run's event loop: arrivals, engine activities (versioned) and embedding deliveries."""

    def __init__(self, spec: VlmRunSpec, trace: Trace, engines: list[VlmEngine], rec: Recorder,
                 overload: OverloadConfig | None = None) -> None:
        """`overload`: the gateway's overload queue with these settings in front of the language pool
        (loadtest/sim/gate.py; as the live gateway, it holds text requests only)."""
        self.spec, self.trace, self.engines, self.rec = spec, trace, engines, rec
        self.language: Policy = build_policy(spec.policy)
        self.vision: Policy = build_policy(spec.vision_policy)
        self.index = {e.id: e.index for e in engines}
        self.heap: list[tuple[float, int, int, int, int]] = []   # (time, tie, kind, engine, payload)
        self.tie = itertools.count()
        self.bytes_moved = 0
        self.gate = None if overload is None else SimGate(
            overload, lambda now: self._pools(now)[0], self._route, self._refused)

    def run(self) -> None:
        lengths = self.trace.lengths
        gate = self.gate
        for i, now in enumerate(self.trace.arrival_s.tolist()):
            while self.heap and self.heap[0][0] <= now:
                self._fire()
            profile = RequestProfile(
                str(i), int(lengths.input_tokens[i]), int(lengths.max_output_tokens[i]), int(lengths.image_tokens[i])
            )
            if gate is None or gate.arrive(i, profile, now):
                self._route(i, profile, now)
        while self.heap or (gate is not None and gate.held):
            if not self.heap:   # held with nothing running: each waits out its start deadline
                assert gate is not None
                gate.release(gate.next_due())
                continue
            self._fire()

    def _schedule(self, k: int, t: float | None) -> None:
        if t is not None:
            heapq.heappush(self.heap, (t, next(self.tie), 0, k, self.engines[k].version))

    def _fire(self) -> None:
        now, _, kind, k, payload = heapq.heappop(self.heap)
        engine = self.engines[k]
        if kind == 1:                                   # an embedding arrived at language engine k
            self._schedule(k, engine.submit(payload, now))
            return
        if payload != engine.version:                   # superseded wake-up
            return
        deliveries, done, nxt = engine.on_event_deliveries(now)
        self._schedule(k, nxt)
        for d in deliveries:
            self._deliver(d, now)
        if self.gate is not None:
            self.gate.engine_event(now, len(done))

    def _deliver(self, d: Delivery, now: float) -> None:
        if d.target == d.source:
            self._schedule(d.target, self.engines[d.target].submit(d.request, now))
            return
        size = perf_model.embedding_bytes(self.engines[d.target].model, int(self.trace.lengths.image_tokens[d.request]))
        self.bytes_moved += size
        heapq.heappush(self.heap, (now + size / PCIE_BYTES_S, next(self.tie), 1, d.target, d.request))

    def _pools(self, now: float) -> tuple[Candidates, Candidates]:
        """(the language pool with the vision backends that would steal its work now, the vision pool)."""
        table = self.engines[0].gateway.refresh(now)
        vision = table.candidates(VISION_ROLES, now)
        language = table.candidates(LANGUAGE_ROLES, now)
        return language.extended(stealers(vision, table.language_backlog(), self.spec.steal_threshold)), vision

    def _refused(self, i: int) -> None:
        self.rec.rejected[i] = True

    def _route(self, i: int, profile: RequestProfile, now: float) -> None:
        lengths = self.trace.lengths
        candidates, vision = self._pools(now)
        if self.gate is None:
            decision = self.language.choose(profile, candidates, now)
        else:   # to a backend that takes it, as the live gateway routes (OverloadQueue.route)
            decision = self.gate.route(lambda within: self.language.choose(profile, within, now), candidates, profile)
        k = self.index[decision.backend.id]
        target = self.engines[k]
        target.acquire(i, now)
        self.rec.backend[i] = k
        if not profile.image_tokens:
            self._schedule(k, target.submit(i, now))
            return
        v = k if target.role == "both" else self.index[self.vision.choose(profile, vision, now).backend.id]
        job = EncodeJob(i, int(lengths.images[i]), profile.image_tokens, k, now)
        self._schedule(v, self.engines[v].encode(job, now))


def run_vlm(spec: VlmRunSpec, catalog: Catalog | None = None) -> dict[str, Any]:
    catalog = catalog or load_catalog()
    started, cpu = time.perf_counter(), time.process_time()
    trace = make_trace(spec.workload, "poisson", spec.rate, spec.n_requests, spec.seed)
    rec = Recorder.for_lengths(trace.lengths)
    engines = build(spec, catalog, rec)
    sim = VlmSimulation(spec, trace, engines, rec)
    sim.run()
    out = summarize(trace, rec, np.array([e.gpu.name for e in engines]), [e.gpu.price_per_hour for e in engines])
    out.update(_cost_and_transfer(spec, catalog, trace, rec, engines, sim.bytes_moved))
    out.update(wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu, rate_rps=spec.rate)
    return out


def _cost_and_transfer(
    spec: VlmRunSpec, catalog: Catalog, trace: Trace, rec: Recorder, engines: list[VlmEngine], moved: int
) -> dict[str, Any]:
    model = catalog.model(spec.model)
    hardware = float(sum(e.gpu.purchase_usd or 0.0 for e in engines))
    images = trace.lengths.image_tokens > 0
    stage_kv = float(sum(perf_model.kv_bytes(model, int(t)) for t in trace.lengths.input_tokens[images]))
    stolen = np.isin(rec.backend, [e.index for e in engines if e.role == "vision"])
    vision_busy = [e.encode_busy_s for e in engines if e.vision]
    return {
        "hardware_usd": hardware,
        "cer_tok_s_per_k_usd": out_rate(rec, trace) / (hardware / 1000.0) if hardware else float("nan"),
        "embedding_mb_per_request": moved / 1e6 / max(1, int(images.sum())),
        "stage_kv_mb_per_request": stage_kv / 1e6 / max(1, int(images.sum())),
        "stolen_share": float(stolen.mean()),
        "vision_busy_share": float(np.mean(vision_busy)) / float(np.nanmax(rec.finish) - trace.arrival_s[0]),
    }


def out_rate(rec: Recorder, trace: Trace) -> float:
    done = ~np.isnan(rec.finish)
    return float(trace.lengths.output_tokens[done].sum()) / float(np.nanmax(rec.finish) - trace.arrival_s[0])
