"""KV budgets and per-GPU service rates: what "1.0× load" means in every experiment.

Load normalisation (capability-weighted paper §4.1, "λ = 1.0× equals the cluster's aggregate service
rate under uniform dispatching"): λ(1.0×) = Σ_i μ_i, where μ_i is GPU i's saturated service rate for
the workload as a whole, i.e. as if it received the uniformly dispatched mix: serial engines 1/E[S_i]
from the paper's formulas, continuous-batching engines measured on one saturated simulated batcher.
Under this reading the round-robin baseline is already past its bottleneck (N · min_i μ_i) at 0.5×,
as the paper's flat Uniform curve (2,147 → 2,222 tok/s from 0.5× to 1.0×) implies.

KV budget of a model too large for one GPU (Llama-2-70B in fp16 is 138 GB): the paper charges no
weights to a GPU's HBM; we follow it and give the KV cache a stated share of HBM (KV_SHARE_OVERSIZE)
while decode steps still stream the full fp16 weights (2·P/B per token, as the paper's formula).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from loadtest.sim import workloads
from loadtest.sim.engines import BatchEngine, Engine, EngineSpec, Recorder

KV_SHARE_OVERSIZE = 0.5     # KV bytes = 0.5 · HBM when the weights cannot fit on the GPU


def weights_fit(model: ModelProfile, gpu: GpuProfile) -> bool:
    return perf_model.kv_capacity_bytes(model, gpu) > 0


def kv_capacity(model: ModelProfile, gpu: GpuProfile, *, encoder_loaded: bool = False) -> int:
    if not weights_fit(model, gpu):
        return perf_model.kv_capacity_bytes(model, gpu, memory_utilization=KV_SHARE_OVERSIZE, decoder_loaded=False)
    return perf_model.kv_capacity_bytes(model, gpu, encoder_loaded=encoder_loaded)


def serial_service_s(model: ModelProfile, gpu: GpuProfile, prompt: float, output: float) -> float:
    """The paper's serial engine: prefill 2·P·L/F, then 2·P/B per output token."""
    prefill = prompt * perf_model.prefill_seconds_per_token(model, gpu)
    return prefill + output * perf_model.serial_decode_seconds_per_token(model, gpu)


def measured_batch_rate(model: ModelProfile, gpu: GpuProfile, workload: str, n: int = 1500) -> float:
    """μ_i of a continuous-batching GPU, measured rather than guessed: saturate one simulated engine with
    `n` requests of the workload's reference sample and count completions per second while its
    waiting queue is non-empty (the batcher's own admission rules, KV reservations and prefill stalls)."""
    return _measured_batch_rate(model, gpu, workload, n)


@cache
def _measured_batch_rate(model: ModelProfile, gpu: GpuProfile, workload: str, n: int) -> float:
    lengths = workloads.lengths(workload, n, workloads.REFERENCE_SEED)
    rec = Recorder.for_lengths(lengths)
    engine = BatchEngine(EngineSpec("calibration", model, gpu, kv_capacity(model, gpu), 1.0), rec)
    return queued_rate(engine, rec, n)


def queued_rate(engine: Engine, rec: Recorder, n: int) -> float:
    """Requests/s `engine` completes with requests 0..n-1 of `rec`'s trace all queued at time 0, counted
    while its queue is not empty (until its last admission)."""
    nxt: float | None = None
    for i in range(n):
        nxt = engine.submit(i, 0.0) or nxt
    while nxt is not None:
        _, nxt = engine.on_event(nxt)
    saturated_until = float(np.nanmax(rec.admitted))
    return float(np.count_nonzero(rec.finish <= saturated_until)) / saturated_until


def service_rate(model: ModelProfile, gpu: GpuProfile, mode: str, workload: str) -> float:
    """μ_i in requests/s for engine `mode` ('serial': exact 1/E[S]; 'continuous': measured)."""
    if mode == "serial":
        prompt, output, _ = workloads.mean_lengths(workload)
        return 1.0 / serial_service_s(model, gpu, prompt, output)
    return measured_batch_rate(model, gpu, workload)
