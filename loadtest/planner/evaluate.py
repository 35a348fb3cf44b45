"""One plan on one trace, in the discrete-event simulator running the gateway's live routing code.

The engines are the simulator's vision-language GPUs (`loadtest.sim.modality.build_members`): the shared
continuous batcher timed by the roofline model, the engines' vision-first loop and aligned encode
batches, reporting to one gateway `StateTable` whose snapshots the gateway's own policies (language pool
and vision pool, as the written backends.yaml names them) route on; stealers join the language
candidates as `gateway.routing.policies.stealing` admits them. T̄_service starts where a live engine's
does (`common.service_time.prior_service_s`), each dispatch takes the live gateway's whole lease
(prompt, reservation, slack: `loadtest.sim.vlm.GatewayLeaseEngine`), and the table's inter-token target
is the SLO's, as the written `gateway.routing.itl_target_ms` makes it live. The gateway's overload queue
stands in front of the language pool as the written `gateway.overload` sets it (`Slo.overload`; `--no-
overload` plans without it): a request it refuses is never served.

A request meets the SLO when its time to first token and its mean inter-token time
((last token − first token) / (tokens − 1)) are both within their targets.

    attainment   share of the trace's requests that met the SLO (a request never served does not)
    late         the same share among the requests of the last LATE_SHARE of the arrival window: a plan
                 that cannot keep up serves its first requests well and its late ones ever later, so a
                 plan sustains the target only if both reach it (a finite trace hides a slow backlog)
    goodput      attainment × arrival rate: requests/s served within the SLO
    tokens/s     output tokens emitted while requests were arriving / that window: what the plan delivers
                 under this traffic, without the drain after the last arrival (loadtest/sim/metrics.py's
                 steady_tok_s; its throughput_tok_s, first arrival → last completion, is kept beside it)
    tokens/$     tokens/s · 3600 / the plan's $/hour
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from common.catalog import Catalog, ModelProfile
from common.service_time import prior_service_s
from loadtest.planner.space import Plan, Slo, trace_rate
from loadtest.sim.engines import Recorder
from loadtest.sim.metrics import summarize
from loadtest.sim.modality import VlmRunSpec, VlmSimulation, build_members
from loadtest.sim.vlm import GatewayLeaseEngine
from loadtest.sim.workloads import Trace

LATE_SHARE = 1 / 3


@dataclass(frozen=True)
class Policies:
    language: str = "marginal_delay"     # the gateway's defaults (gateway.routing)
    vision: str = "encode_cost"
    overload: bool = True                # the overload queue (gateway.overload), on by default, at the SLO's TTFT


@dataclass(frozen=True)
class Outcome:
    attainment: float
    late_attainment: float
    goodput_rps: float
    tokens_per_s: float              # steady: emitted while requests arrive / that window
    tokens_per_dollar: float
    throughput_tok_s: float          # output tokens / (first arrival → last completion): with the drain
    ttft_p95_s: float
    itl_p95_s: float
    completed: int
    cost_per_hour: float
    wall_s: float
    cpu_s: float

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}

    def sustains(self, target: float) -> bool:
        return self.attainment >= target and self.late_attainment >= target


def outcome(trace: Trace, rec: Recorder, slo: Slo, cost_per_hour: float, started: float, cpu: float) -> Outcome:
    """The metrics of the module docstring from a run's per-request times (`rec`, indexed like the trace):
    the simulator's, or the live gateway's (live_check.py) measured by this same function."""
    summary = summarize(trace, rec, np.array([], dtype=str), [cost_per_hour or 1.0])   # its per-$ figure unused
    ttft = rec.first_token - trace.arrival_s
    tokens = trace.lengths.output_tokens
    itl = np.where(tokens > 1, (rec.finish - rec.first_token) / np.maximum(tokens - 1, 1), 0.0)
    done = ~np.isnan(rec.finish)
    with np.errstate(invalid="ignore"):
        good = done & (ttft <= slo.ttft_s) & (itl <= slo.itl_s)
    start, end = float(trace.arrival_s[0]), float(trace.arrival_s[-1])
    late = trace.arrival_s >= end - (end - start) * LATE_SHARE
    attainment, steady = float(good.mean()), float(summary["steady_tok_s"])
    return Outcome(
        attainment=attainment, late_attainment=float(good[late].mean()),
        goodput_rps=attainment * trace_rate(trace), tokens_per_s=steady,
        tokens_per_dollar=steady * 3600 / cost_per_hour if cost_per_hour else float("inf"),
        throughput_tok_s=float(summary["throughput_tok_s"]),
        ttft_p95_s=float(np.percentile(ttft[done], 95)) if done.any() else float("inf"),
        itl_p95_s=float(np.percentile(itl[done], 95)) if done.any() else float("inf"),
        completed=int(done.sum()), cost_per_hour=cost_per_hour, wall_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu)


def simulate(plan: Plan, trace: Trace, model: ModelProfile, catalog: Catalog, slo: Slo,
             policies: Policies = Policies()) -> Outcome:
    """Run the trace through the plan (module docstring)."""
    started, cpu = time.perf_counter(), time.process_time()
    rec = Recorder.for_lengths(trace.lengths)
    engines = build_members(plan.members(), model, catalog, rec, lambda gpu: prior_service_s(model, gpu),
                            GatewayLeaseEngine)
    engines[0].gateway.table.itl_target_s = slo.itl_s
    spec = VlmRunSpec(plan.label(), trace_rate(trace), trace.n, model=model.name, policy=policies.language,
                      vision_policy=policies.vision)
    VlmSimulation(spec, trace, engines, rec, slo.overload() if policies.overload else None).run()
    return outcome(trace, rec, slo, plan.cost_per_hour(catalog), started, cpu)
