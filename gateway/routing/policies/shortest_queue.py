"""`shortest_queue`: join the shortest queue.

    cost(i) = Q_i        (ties: the first candidate)

Reads queue_depth. Limits: a slow GPU with a short queue looks as good as a fast one.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class ShortestQueueParams(StrictModel):
    pass


def queue_costs(candidates: Sequence[BackendSnapshot]) -> tuple[CostTerms, ...]:
    return tuple(CostTerms(b.id, 0.0, float(b.queue_depth), 0.0, float(b.queue_depth)) for b in candidates)


class ShortestQueue:
    name = "shortest_queue"
    Params = ShortestQueueParams

    def __init__(self, params: ShortestQueueParams | None = None) -> None:
        pass

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        costs = queue_costs(candidates)
        best = min(range(len(candidates)), key=lambda i: costs[i].total)
        return Decision(candidates[best], self.name, costs)
