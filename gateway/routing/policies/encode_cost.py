"""`encode_cost`: capability-weighted choice of a vision backend (the vision pool's heteroserve).

    cost(r, v) = encode(image tokens of r, v) + vision_backlog(v) / encode rate(v)
               = (I_r + B_v) · t_v,      t_v = 2 · encoder params · patches per token / F_v

Reads encode_s_per_token (t_v, from the performance model) and vision_backlog (B_v, image tokens
queued or in flight). No parameters. Limits: batching makes real encode time sublinear in the
backlog; the estimate is an upper bound that ranks GPUs correctly.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class EncodeCostParams(StrictModel):
    pass


class EncodeCost:
    name = "encode_cost"
    Params = EncodeCostParams

    def __init__(self, params: EncodeCostParams | None = None) -> None:
        pass

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        tokens = request.image_tokens
        costs = []
        best_i, best = 0, float("inf")
        for i, b in enumerate(candidates):
            own = tokens * b.encode_s_per_token
            queue = b.vision_backlog * b.encode_s_per_token
            costs.append(CostTerms(b.id, own, queue, 0.0, own + queue))
            if own + queue < best:
                best_i, best = i, own + queue
        return Decision(candidates[best_i], self.name, tuple(costs))
