"""`batch_aware`: a continuous-batching-aware estimate of time to first token, plus a decode term.

HeteroServe's T_queue = Q_i · T̄_service(i) (Eq. 3) models a serial GPU: every request in the queue
runs before this one. Under continuous batching the Q_i requests run *together*; a new one waits only
when the KV cache (or the batch cap) is full, and then for the cache to turn over, not for Q_i whole
services. This policy estimates, per candidate i, for a request with L input tokens and M max new tokens:

    R       = L + M                                     KV tokens the engine reserves at admission
    K_i     = kv_total_bytes / kv_bytes_per_token       cache size in tokens
    D_i     = max(K_i - kv_free_tokens, Q_i · R)        tokens held or queued ahead (Q_i = queue_depth)
    X_i     = max((D_i + R) / K_i, (Q_i + 1) / max_batch) - 1
    T_wait  = max(0, X_i) · T̄_service(i)               a full cache turns over once per service time
    b_i     = min(Q_i + 1, K_i / R, max_batch)          batch after admission
    T_step  = max((W + reserved KV bytes) / B_i,  p_i · b_i)      roofline step: weights + KV vs compute
    cost    = T_wait + T_step + L · p_i  +  w_decode · f · M · T_step  +  veto · 1[R > K_i]

with p_i = prefill_s_per_token = 2P/F_i, W = bytes_per_param · P recovered as p_i · F_i / 2 · bytes_per_param,
B_i = bandwidth. The first three terms are the estimated TTFT (admission wait, the step that prefills
it, its own prefill); the fourth is the expected decode time (f · M tokens at this GPU's step time),
the bandwidth term HeteroServe lacks; KV pressure enters softly through T_wait, and the veto only
removes GPUs whose whole cache could never hold the request (the batcher would reject it).

Reads: queue_depth, kv_free_bytes, kv_total_bytes, kv_bytes_per_token, mean_service_s,
prefill_s_per_token, tflops, bandwidth_gbs. Parameters: w_decode (0.1), output_fraction f (0.5),
max_batch (the engines' batch cap, 256; 1 describes the paper's serial engine and turns T_wait into
Q_i · T̄_service), bytes_per_param (2, fp16 weights), veto (1e6 s).
Limits: the reserved KV (prompt + max tokens) overstates the context a step reads; Q_i · R assumes
queued requests are the size of this one; output length is a fixed fraction of max tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from gateway.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile
from gateway.yaml_files import StrictModel


class BatchAwareParams(StrictModel):
    w_decode: float = Field(default=1.0, ge=0)
    output_fraction: float = Field(default=0.5, gt=0, le=1)
    max_batch: int = Field(default=256, ge=1)
    bytes_per_param: float = Field(default=2.0, gt=0)
    size_ewma: float = Field(default=0.02, gt=0, le=1)
    veto: float = Field(default=1e6, ge=0)


class BatchAware:
    name = "batch_aware"
    Params = BatchAwareParams

    def __init__(self, params: BatchAwareParams | None = None) -> None:
        self.p = params or BatchAwareParams()
        self.mean_reserve: dict[str, float] = {}    # R̄_i: EWMA of the reservations routed to backend i

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        reserve = request.input_tokens + request.max_output_tokens
        costs = tuple(self.cost(request, b) for b in candidates)
        best = min(range(len(candidates)), key=lambda i: costs[i].total)
        chosen = candidates[best]
        old = self.mean_reserve.get(chosen.id, float(reserve))
        self.mean_reserve[chosen.id] = old + (reserve - old) * self.p.size_ewma
        return Decision(chosen, self.name, costs)

    def cost(self, request: RequestProfile, b: BackendSnapshot) -> CostTerms:
        p = self.p
        length, new_tokens = request.input_tokens, request.max_output_tokens
        reserve = length + new_tokens
        if not b.kv_bytes_per_token or reserve * b.kv_bytes_per_token > b.kv_total_bytes:
            return CostTerms(b.id, 0.0, 0.0, p.veto, p.veto)
        kv_tokens = b.kv_total_bytes / b.kv_bytes_per_token
        queue = b.queue_depth
        ahead = max(kv_tokens - b.kv_free_tokens, queue * self.mean_reserve.get(b.id, reserve))
        overflow = max((ahead + reserve) / kv_tokens, (queue + 1) / p.max_batch) - 1.0
        wait = max(0.0, overflow) * b.mean_service_s
        full_batch = min(kv_tokens / reserve, p.max_batch)
        weights = b.prefill_s_per_token * b.tflops * 1e12 / 2.0 * p.bytes_per_param
        reserved = b.kv_total_bytes - b.kv_free_bytes
        step = max((weights + reserved) / (b.bandwidth_gbs * 1e9), b.prefill_s_per_token * min(queue + 1, full_batch))
        first = step + length * b.prefill_s_per_token
        decode = p.w_decode * p.output_fraction * new_tokens * step
        return CostTerms(b.id, first, wait, 0.0, wait + first + decode)
