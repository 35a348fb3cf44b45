"""`heteroserve`: the capability-weighted cost function, Eq. 1-4 and Algorithm 1 of the
capability-weighted routing paper, kept exactly.

    cost(r, i) = w1 · T_prefill(L_r, i) + w2 · T_queue(i) + w3 · 1[OOM(r, i)]        (1)
    T_prefill  = 2 · P · L_r / F_i                                                     (2)
    T_queue    = Q_i · T̄_service(i)                                                    (3)
    OOM(r, i)  = L_r > M_free_i / KV-per-token                                         (4)

Reads: prefill_s_per_token (2P/F_i), queue_depth (Q_i), mean_service_s, kv_free_bytes,
kv_bytes_per_token. Parameters: w1, w2, w3 (defaults 1, 1, 100; seconds, so w3 ≫ the others).
w2 = 0 is device-specific shortest-job-first; w1 = 0 is shortest queue (ties: first candidate).
Limits: no decode or bandwidth term (only through T̄_service), the queue term counts requests, not
their lengths, and the veto is binary.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from gateway.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile
from gateway.yaml_files import StrictModel


class HeteroServeParams(StrictModel):
    w1: float = Field(default=1.0, ge=0)
    w2: float = Field(default=1.0, ge=0)
    w3: float = Field(default=100.0, ge=0)


class HeteroServe:
    name = "heteroserve"
    Params = HeteroServeParams

    def __init__(self, params: HeteroServeParams | None = None) -> None:
        p = params or HeteroServeParams()
        self.w1, self.w2, self.w3 = p.w1, p.w2, p.w3

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        w1, w2, w3 = self.w1, self.w2, self.w3
        length = request.input_tokens
        costs = []
        best_i, best = 0, float("inf")
        for i, b in enumerate(candidates):
            c1 = w1 * length * b.prefill_s_per_token
            c2 = w2 * b.queue_depth * b.mean_service_s
            c3 = w3 if length * b.kv_bytes_per_token > b.kv_free_bytes else 0.0
            total = c1 + c2 + c3
            costs.append(CostTerms(b.id, c1, c2, c3, total))
            if total < best:
                best_i, best = i, total
        return Decision(candidates[best_i], self.name, tuple(costs))
