"""`least_image_tokens`: the vision backend with the fewest image tokens waiting (ModServe §6.5).

    cost(v) = vision_backlog(v)        (ties: the first candidate)

Reads vision_backlog. Limits: blind to GPU speed; a slow GPU with a short backlog wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class LeastImageTokensParams(StrictModel):
    pass


class LeastImageTokens:
    name = "least_image_tokens"
    Params = LeastImageTokensParams

    def __init__(self, params: LeastImageTokensParams | None = None) -> None:
        pass

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        costs = tuple(CostTerms(b.id, 0.0, float(b.vision_backlog), 0.0, float(b.vision_backlog)) for b in candidates)
        best = min(range(len(candidates)), key=lambda i: costs[i].total)
        return Decision(candidates[best], self.name, costs)
