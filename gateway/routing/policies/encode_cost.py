"""`encode_cost`: capability-weighted choice of a vision backend (the vision pool's heteroserve).

    cost(r, v) = encode(image tokens of r not cached on v, v) + vision_backlog(v) / encode rate(v)
               = (I_r − H_v + B_v) · t_v,      t_v = 2 · encoder params · patches per token / F_v

H_v: the image tokens of r whose embeddings v is predicted to hold (`RequestProfile.cached_image_tokens`,
from `gateway.routing.encoder_index`): a hit is no encode, so a repeated image goes back to the
encoder that holds it unless that encoder's backlog costs more than encoding it elsewhere (B_v · t_v
against (I_r + B_w) · t_w), a slow encoder's hit weighed against a fast one's miss in seconds.
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
        tokens, cached = request.image_tokens, request.cached_image_tokens
        costs = []
        best_i, best = 0, float("inf")
        for i, b in enumerate(candidates):
            own = max(0, tokens - cached.get(b.id, 0)) * b.encode_s_per_token
            queue = b.vision_backlog * b.encode_s_per_token
            costs.append(CostTerms(b.id, own, queue, 0.0, own + queue))
            if own + queue < best:
                best_i, best = i, own + queue
        return Decision(candidates[best_i], self.name, tuple(costs))
