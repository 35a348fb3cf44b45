"""`batch_aware`: least estimated time to first token on a continuous-batching GPU.

HeteroServe's T_queue = Q_i · T̄_service(i) (Eq. 3) models a serial GPU: every request in the queue
runs before this one. Under continuous batching the Q_i requests run *together*; a new one waits only
when the KV cache (or the batch cap) is full, and then for part of the cache to turn over, not for
Q_i whole services. For a request with L input and M max new tokens, on candidate i:

    R        = L + M                                  KV tokens the batcher reserves at admission
    K_i      = kv_total_bytes / kv_bytes_per_token    cache size in tokens
    A_i      = max(K_i - kv_free_tokens, Q_i · R̄_i)  tokens held or queued ahead (R̄_i: see below)
    X_i      = max((A_i + R) / K_i, (Q_i + 1) / max_batch) - 1
    T_wait   = max(0, X_i) · T̄_service(i)            a full cache turns over once per service time
    T_step   = max((W + reserved KV bytes) / B_i,  p_i · min(Q_i + 1, K_i / R, max_batch))
    B_i      = prompt tokens this router sent to i whose first token has not come (prefilled first)
    cost     = w_wait · T_wait + w_step · T_step + w_prefill · (B_i + L) · p_i + w_decode · f · M · T_step
               + veto · 1[R > K_i]

p_i = the learned prefill rate (learned_prefill_s_per_token, common.speed_estimator), 2P/F_i before
any sample; W = the decoder's weight bytes; B_i = bandwidth. T_step is the
roofline time of the step that admits the request (weights + KV streamed vs batch compute), computed
by the performance model (`perf_model.roofline_step_seconds`, as the engines time their steps), so
the bandwidth tier enters every decision; w_wait · T_wait + T_step +
(B_i + L) · p_i is the TTFT estimate. B_i: a chunked-prefill engine serves the prompts ahead before
this one; without it every burst herded onto the fastest-prefill tier (TTFT misses on the H100s:
44% goodput at 0.6x of capacity in a virtual-time replay of benchmarks/mixed_tier.py's engines,
99.9% with it). R̄_i is an EWMA of the reservations this router sent to backend i:
with A_i it counts the requests queued behind a blocked FIFO head (Q_i - running ≈ Q_i - used / R̄_i),
which the free-KV signal alone cannot see. KV pressure is soft (through T_wait); the veto only
removes backends whose whole cache could never hold the request (the batcher would reject it).
w_decode (default 0) adds the expected decode time f · M · T_step, i.e. turns the cost into an E2E
estimate; the simulator's ablation (docs/BENCHMARKS.md) shows it costs TTFT and buys no throughput.

Reads: queue_depth, kv_free_bytes, kv_total_bytes, kv_bytes_per_token, mean_service_s,
learned_prefill_s_per_token (else prefill_s_per_token), prefill_backlog_tokens, weight_bytes,
bandwidth_gbs.
State: R̄_i per backend id. Parameters: w_wait, w_step, w_prefill (1), w_decode (0), output_fraction
f (0.5), max_batch (the engines' batch cap, 256; 1 is the paper's serial engine and turns T_wait
into HeteroServe's Q_i · T̄_service), size_ewma (0.02), veto (1e6 s).
Limits: it minimises time to first token only. Under an inter-token target it overloads the slow
tier (whose first token comes soonest while its prefill queue is empty) and misses there on
inter-token time; `marginal_delay`, which also counts the stall a prefill puts on the requests
decoding and each request's own decode, is the default for continuous batching. Reserved KV
(prompt + max tokens) overstates the context a step reads; the turnover model assumes running
requests finish evenly over T̄_service; no heartbeat lag is modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from common import perf_model
from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class BatchAwareParams(StrictModel):
    w_wait: float = Field(default=1.0, ge=0)
    w_step: float = Field(default=1.0, ge=0)
    w_prefill: float = Field(default=1.0, ge=0)
    w_decode: float = Field(default=0.0, ge=0)
    output_fraction: float = Field(default=0.5, gt=0, le=1)
    max_batch: int = Field(default=256, ge=1)
    size_ewma: float = Field(default=0.02, gt=0, le=1)
    veto: float = Field(default=1e6, ge=0)


class BatchAware:
    name = "batch_aware"
    Params = BatchAwareParams

    def __init__(self, params: BatchAwareParams | None = None) -> None:
        self.p = params or BatchAwareParams()
        self.mean_reserve: dict[str, float] = {}    # R̄_i

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        costs = tuple(self.cost(request, b) for b in candidates)
        best = min(range(len(candidates)), key=lambda i: costs[i].total)
        chosen = candidates[best]
        reserve = request.input_tokens + request.max_output_tokens
        old = self.mean_reserve.get(chosen.id, float(reserve))
        self.mean_reserve[chosen.id] = old + (reserve - old) * self.p.size_ewma
        return Decision(chosen, self.name, costs)

    def cost(self, request: RequestProfile, b: BackendSnapshot) -> CostTerms:
        """Cost terms: prefill = w_step · T_step + w_prefill · L · p_i, queue = w_wait · T_wait, oom = veto."""
        p = self.p
        length, new_tokens = request.input_tokens, request.max_output_tokens
        reserve = length + new_tokens
        if not b.kv_bytes_per_token or reserve * b.kv_bytes_per_token > b.kv_total_bytes:
            return CostTerms(b.id, 0.0, 0.0, p.veto, p.veto)
        kv_tokens = b.kv_total_bytes / b.kv_bytes_per_token
        queue = b.queue_depth
        ahead = max(kv_tokens - b.kv_free_tokens, queue * self.mean_reserve.get(b.id, reserve))
        overflow = max((ahead + reserve) / kv_tokens, (queue + 1) / p.max_batch) - 1.0
        wait = p.w_wait * max(0.0, overflow) * b.mean_service_s
        rate = b.learned_prefill_s_per_token or b.prefill_s_per_token
        step = perf_model.roofline_step_seconds(
            b.weight_bytes + b.kv_total_bytes - b.kv_free_bytes, b.bandwidth_gbs * 1e9,
            min(queue + 1, kv_tokens / reserve, p.max_batch), rate,
        )
        first = p.w_step * step + p.w_prefill * (b.prefill_backlog_tokens + length) * rate
        decode = p.w_decode * p.output_fraction * new_tokens * step
        return CostTerms(b.id, first, wait, 0.0, wait + first + decode)
