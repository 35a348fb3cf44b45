"""One fleet of vision and language pools on one trace, static or run by the gateway's own scaler, in
the discrete-event simulator.

The engines, routing and batching are the planner's (`loadtest.sim.modality`: the gateway's policies on
its own `StateTable`, the shared continuous batcher timed by the roofline model). Two things are added:

- **pools that change during the run.** Every `interval_s` of virtual time the fleet reads each pool's
  demand with `gateway.control.autoscaler.pool_demand` and decides with `gateway.control.autoscaler.Scaler`,
  the very code the live gateway's loop runs, and applies the step as the live loop does: each new engine
  of the step, of the pool's GPU, is registered `starting` and becomes ready (a candidate) `startup_s`
  later, the time a real engine takes to load its weights; a step down drains the engines the scaler
  added last (no new requests; what each holds finishes: queued and running language work, images to
  encode, requests whose embeddings are on their way) and stops each at the first tick it holds nothing.
  The pool's first `min` engines are its fixed ones; engines above `min` at the start count as added (the
  scaler may remove them).
- **what the fleet costs.** An engine is paid from its launch (its start-up included) to its stop, or to
  the run's last completion; GPU-seconds and dollars are summed over engines at the catalog's hourly
  prices, dollars per million output tokens divide them by the tokens the fleet generated.

The language engines take the gateway's full lease at dispatch (prompt and image tokens, max_tokens), as
the live pipeline does, so the scaler's prefill-backlog and predicted-TTFT signals read what they read live.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from common.catalog import Catalog, ModelProfile
from common.service_time import prior_service_s
from gateway.config.autoscaling import AutoscalingConfig, Pool
from gateway.control.autoscaler import Scaler, pool_demand
from loadtest.planner.evaluate import Outcome, Policies, outcome
from loadtest.planner.space import Slo, trace_rate
from loadtest.sim.engines import EngineSpec, GatewayState, Recorder
from loadtest.sim.modality import VlmRunSpec, VlmSimulation, build_member
from loadtest.sim.vlm import EncodeJob, GatewayLeaseEngine
from loadtest.sim.workloads import Trace

POOLS: tuple[Pool, ...] = ("vision", "language")
# The gateway's routing defaults, without its overload queue: the tables of docs/PLANNING.md's autoscaling
# section were made so (the queue refuses text requests a burst would make late, where the pools' growth
# is what is measured).
DEFAULT_POLICIES = Policies(overload=False)
_TICK, _READY = 2, 3      # event kinds beside the simulation's own (0: an engine's activity, 1: an embedding)


@dataclass(frozen=True)
class Fleet:
    """A vision pool and a language pool, one GPU type each; `scaling` (mode manage) runs them, else static."""

    name: str
    gpus: dict[Pool, str]
    engines: dict[Pool, int]             # at the start
    scaling: AutoscalingConfig | None = None
    startup_s: float = 30.0              # launch to ready, for engines the scaler adds

    def __post_init__(self) -> None:
        if any(self.engines[p] < 1 for p in POOLS):
            raise ValueError(f"{self.name}: each pool needs at least one engine at the start")
        if self.scaling is not None:
            pools = self.scaling.scaled()
            if self.scaling.mode != "manage" or set(pools) != set(POOLS):
                raise ValueError(f"{self.name}: the scaler must manage both pools")
            for p in POOLS:
                if not pools[p].min <= self.engines[p] <= pools[p].max:
                    raise ValueError(f"{self.name}: {self.engines[p]} {p} engines at the start is outside "
                                     f"[{pools[p].min}, {pools[p].max}]")


@dataclass(frozen=True)
class FleetResult:
    fleet: str
    outcome: Outcome
    gpu_seconds: dict[Pool, float]
    dollars: float
    output_tokens: int
    lost: int                    # requests never completed
    routed_while_draining: int   # requests sent to an engine after its drain began (must be 0)
    steps: dict[str, int]        # scaler steps (a step up may add several engines): "vision+", "vision-", ...
    peak_engines: dict[Pool, int]
    end_s: float                 # the last completion: where the bill stops
    timeline: list[tuple[float, int, int]] = field(repr=False)   # (t, vision engines, language engines), per tick

    @property
    def usd_per_million_tokens(self) -> float:
        return self.dollars / self.output_tokens * 1e6 if self.output_tokens else float("inf")


class PoolEngine(GatewayLeaseEngine):
    """A simulated engine that takes the gateway's full lease and counts work routed to it while it drains."""

    def __init__(self, spec: EngineSpec, rec: Recorder, index: int, gateway: GatewayState | None = None) -> None:
        super().__init__(spec, rec, index, gateway)
        self.draining = False
        self.routed_while_draining = 0
        self.started_s = 0.0
        self.stopped_s: float | None = None

    def acquire(self, i: int, now: float) -> None:
        self.routed_while_draining += self.draining
        super().acquire(i, now)

    def encode(self, job: EncodeJob, now: float) -> float | None:
        self.routed_while_draining += self.draining
        return super().encode(job, now)


class FleetSimulation(VlmSimulation):
    """The trace through one fleet (module docstring)."""

    def __init__(self, fleet: Fleet, trace: Trace, model: ModelProfile, catalog: Catalog, slo: Slo,
                 policies: Policies = DEFAULT_POLICIES) -> None:
        self.fleet, self.model, self.catalog = fleet, model, catalog
        self.rec = Recorder.for_lengths(trace.lengths)
        self.gateway = GatewayState(model)
        self.gateway.table.itl_target_s = slo.itl_s
        self.pool_of: dict[str, Pool] = {}
        self.added: dict[Pool, list[PoolEngine]] = {p: [] for p in POOLS}   # by the scaler, in order; not draining
        self.arriving: set[str] = set()
        self.leaving: dict[str, PoolEngine] = {}
        self.steps = {f"{p}{s}": 0 for p in POOLS for s in "+-"}
        self.timeline: list[tuple[float, int, int]] = []
        spec = VlmRunSpec(fleet.name, trace_rate(trace), trace.n, model=model.name, policy=policies.language,
                          vision_policy=policies.vision)
        super().__init__(spec, trace, [], self.rec, slo.overload() if policies.overload else None)
        pools = fleet.scaling.scaled() if fleet.scaling is not None else {}
        for pool in POOLS:
            fixed = pools[pool].min if pool in pools else fleet.engines[pool]
            for k in range(fleet.engines[pool]):
                engine = self._launch(pool, 0.0, ready=True)
                if k >= fixed:
                    self.added[pool].append(engine)
        self.scaler = Scaler(fleet.scaling, lambda: self.now) if fleet.scaling is not None else None
        self.now = 0.0
        if self.scaler is not None:
            heapq.heappush(self.heap, (0.0, next(self.tie), _TICK, -1, 0))

    # -- the pools' engines ------------------------------------------------------------------

    def _launch(self, pool: Pool, now: float, ready: bool) -> PoolEngine:
        index = len(self.engines)
        backend_id = f"{pool}-{index}"
        engine = build_member(backend_id, index, self.fleet.gpus[pool], pool, False, self.model, self.catalog,
                              self.rec, lambda gpu: prior_service_s(self.model, gpu), self.gateway, PoolEngine)
        assert isinstance(engine, PoolEngine)
        engine.started_s = now
        self.engines.append(engine)
        self.index[backend_id] = index
        self.pool_of[backend_id] = pool
        if not ready:
            self.gateway.table.set_lifecycle(backend_id, "starting")
            self.arriving.add(backend_id)
            heapq.heappush(self.heap, (now + self.fleet.startup_s, next(self.tie), _READY, index, 0))
        return engine

    def _ready(self, index: int) -> None:
        engine = self.engines[index]
        self.gateway.table.set_lifecycle(engine.id, "ready")
        engine.changed = True                     # it reports at the next decision: healthy from then on
        self.arriving.discard(engine.id)

    def _drain(self, pool: Pool) -> None:
        engine = self.added[pool].pop()
        self.gateway.table.drain(engine.id)
        engine.draining = True
        self.arriving.discard(engine.id)
        self.leaving[engine.id] = engine

    def _stop_drained(self, now: float) -> None:
        for backend_id, engine in list(self.leaving.items()):
            if engine.holds_work():
                continue
            self.gateway.table.unregister(backend_id)
            self.gateway.engines.remove(engine)
            engine.stopped_s = now
            del self.leaving[backend_id]

    # -- the scaler ----------------------------------------------------------------------------

    def _fire(self) -> None:
        now, _, kind, k, _payload = self.heap[0]
        if kind not in (_TICK, _READY):
            super()._fire()
            return
        heapq.heappop(self.heap)
        self.now = now
        if kind == _READY:
            self._ready(k)
        else:
            self._tick(now)

    def _tick(self, now: float) -> None:
        """One pass of the live loop (gateway/control/autoscaler.py's Autoscaler.tick) on the simulated pools."""
        assert self.scaler is not None and self.fleet.scaling is not None
        self._stop_drained(now)
        table = self.gateway.refresh(now)
        pools = self.scaler.pools
        demand = {pool: pool_demand(table, pool, pools[pool],
                                    arriving=sum(self.pool_of[i] == pool for i in self.arriving),
                                    leaving=sum(self.pool_of[i] == pool for i in self.leaving),
                                    addable=len(pools[pool].gpus) - len(self.added[pool]),
                                    removable=len(self.added[pool])) for pool in POOLS}
        for pool, decision in self.scaler.decide(demand).items():
            change = decision.desired - decision.current
            if change > 0:
                self.added[pool].extend(self._launch(pool, now, ready=False) for _ in range(change))
                self.steps[f"{pool}+"] += 1
            elif change < 0:
                for _ in range(-change):
                    self._drain(pool)
                self.steps[f"{pool}-"] += 1
        self.timeline.append((now, demand["vision"].engines, demand["language"].engines))
        if self._work_left(now):
            heapq.heappush(self.heap, (now + self.fleet.scaling.interval_s, next(self.tie), _TICK, -1, 0))

    def _work_left(self, now: float) -> bool:
        pending = np.isnan(self.rec.finish) & ~self.rec.rejected
        return now < float(self.trace.arrival_s[-1]) or bool(self.leaving) or bool(pending.any())

    # -- the bill ------------------------------------------------------------------------------

    def result(self, slo: Slo, started: float, cpu: float) -> FleetResult:
        done = ~np.isnan(self.rec.finish)
        end = float(np.nanmax(self.rec.finish)) if done.any() else float(self.trace.arrival_s[-1])
        gpu_seconds: dict[Pool, float] = {p: 0.0 for p in POOLS}
        dollars = 0.0
        for engine in self.engines:
            assert isinstance(engine, PoolEngine)
            paid = min(end if engine.stopped_s is None else engine.stopped_s, end) - engine.started_s
            pool = self.pool_of[engine.id]
            gpu_seconds[pool] += max(paid, 0.0)
            dollars += max(paid, 0.0) * engine.gpu.price_per_hour / 3600
        peak: dict[Pool, int] = dict(self.fleet.engines)
        for row in self.timeline:
            peak = {"vision": max(peak["vision"], row[1]), "language": max(peak["language"], row[2])}
        hours = end / 3600
        tokens = int(self.trace.lengths.output_tokens[done].sum())
        return FleetResult(
            fleet=self.fleet.name,
            outcome=outcome(self.trace, self.rec, slo, dollars / hours if hours else 0.0, started, cpu),
            gpu_seconds=gpu_seconds, dollars=dollars, output_tokens=tokens, lost=int((~done).sum()),
            routed_while_draining=sum(e.routed_while_draining for e in self.engines if isinstance(e, PoolEngine)),
            steps=dict(self.steps), peak_engines=peak, end_s=end,
            timeline=self.timeline)


def run_fleet(fleet: Fleet, trace: Trace, model: ModelProfile, catalog: Catalog, slo: Slo,
              policies: Policies = DEFAULT_POLICIES) -> FleetResult:
    """The trace through `fleet`, to its last completion."""
    started, cpu = time.perf_counter(), time.process_time()
    sim = FleetSimulation(fleet, trace, model, catalog, slo, policies)
    sim.run()
    return sim.result(slo, started, cpu)
