"""`heteroserve`: the capability-weighted cost function, Eq. 1-4 and Algorithm 1 of the
capability-weighted routing paper, kept exactly.

    cost(r, i) = w1 · T_prefill(L_r, i) + w2 · T_queue(i) + w3 · 1[OOM(r, i)]        (1)
    T_prefill  = 2 · P · L_r / F_i                                                     (2)
    T_queue    = Q_i · T̄_service(i)                                                    (3)
    OOM(r, i)  = L_r > M_free_i / KV-per-token                                         (4)

Reads: prefill_s_per_token (2P/F_i), queue_depth (Q_i), mean_service_s, kv_free_bytes,
kv_bytes_per_token. Parameters: w1, w2, w3 (defaults 1, 1, 100; seconds, so w3 ≫ the others).
w2 = 0 is device-specific shortest-job-first; w1 = 0 is shortest queue (ties: first candidate).
Computed over the candidates' columns (`gateway.routing.policies.candidates`), one array operation per
term, the per-candidate `CostTerms` built only when `Decision.costs` is read; up to LOOP_UP_TO
candidates, by a loop over them (`cost`), the same arithmetic.
Limits: no decode or bandwidth term (only through T̄_service), the queue term counts requests, not
their lengths, and the veto is binary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from common.yaml_files import StrictModel
from gateway.routing.policies.candidates import (
    KV_FIT,
    LOOP_UP_TO,
    PREFILL,
    QUEUE,
    QUEUE_S,
    SERVICE,
    Candidates,
    first_argmin,
    first_lowest,
)
from gateway.routing.policies.contracts import BackendSnapshot, CostColumns, CostTerms, Decision, RequestProfile


class HeteroServeParams(StrictModel):
    w1: float = Field(default=1.0, ge=0)
    w2: float = Field(default=1.0, ge=0)
    w3: float = Field(default=100.0, ge=0, allow_inf_nan=True)   # .inf: the paper's hard veto (ge refuses .nan)


class HeteroServe:
    name = "heteroserve"
    Params = HeteroServeParams

    def __init__(self, params: HeteroServeParams | None = None) -> None:
        p = params or HeteroServeParams()
        self.w1, self.w2, self.w3 = p.w1, p.w2, p.w3

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        if len(candidates) <= LOOP_UP_TO:   # a few candidates: Algorithm 1's loop is cheaper than arrays
            length = request.input_tokens
            costs = tuple([self.cost(length, b) for b in candidates])
            return Decision(candidates[first_lowest([c.total for c in costs])], self.name, costs)
        # Algorithm 1, lines 2-6, one array operation per term over the candidates' columns. Each
        # element is the same IEEE arithmetic, in the same order, as the scalar form
        # (w1·L)·p_i + (w2·Q_i)·T̄_i + w3·1[L > fit_i], so costs and ties are exactly the loop's
        # (with w2 = 1, (1·Q_i)·T̄_i is the Q_i·T̄_i column itself).
        chosen = Candidates.of(candidates)
        columns = chosen.columns
        length = request.input_tokens
        prefill = columns[PREFILL] * (self.w1 * length)   # 0 · inf is NaN, overflow inf, as in Python
        if self.w2 == 1.0:
            queue = columns[QUEUE_S]
        else:
            queue = columns[QUEUE] * self.w2
            queue *= columns[SERVICE]
        total = prefill + queue
        veto = columns[KV_FIT] < float(length)   # exact (L < 2^53), and a float compares faster than an int
        oom = None
        if np.count_nonzero(veto):   # .any() costs three times as much on small arrays
            oom = np.where(veto, self.w3, 0.0)
            total += oom
        i = first_argmin(total)
        return Decision(chosen[i], self.name, CostColumns(chosen.ids, prefill, queue, oom, total, i))

    def cost(self, length: int, b: BackendSnapshot) -> CostTerms:
        """One candidate's terms, with the arithmetic of the columns: (w1·L)·p_i, (w2·Q_i)·T̄_i (Q_i·T̄_i
        when w2 = 1) and the veto when L exceeds M_free_i / KV-per-token rounded down."""
        prefill = (self.w1 * length) * b.prefill_s_per_token
        queue = b.queue_depth * b.mean_service_s if self.w2 == 1.0 else (b.queue_depth * self.w2) * b.mean_service_s
        per_token = b.kv_bytes_per_token
        total = prefill + queue
        if (b.kv_free_bytes // per_token < length) if per_token else b.kv_free_bytes < 0:
            return CostTerms(b.id, prefill, queue, self.w3, total + self.w3)
        return CostTerms(b.id, prefill, queue, 0.0, total)
