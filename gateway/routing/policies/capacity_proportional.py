"""`capacity_proportional`: static weighted round robin, each GPU's share ∝ its TFLOPS.

Smooth weighted round robin (as in nginx): every pick adds each candidate's weight to its credit,
takes the highest credit and subtracts the total weight from it. Deterministic, and the shares hold
over any window of sum(weights) picks. Reads tflops. Limits: ignores load and request length.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class CapacityProportionalParams(StrictModel):
    pass


class CapacityProportional:
    name = "capacity_proportional"
    Params = CapacityProportionalParams

    def __init__(self, params: CapacityProportionalParams | None = None) -> None:
        self._credit: dict[str, float] = {}

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        total = 0.0
        best_i, best = 0, float("-inf")
        for i, b in enumerate(candidates):
            credit = self._credit.get(b.id, 0.0) + b.tflops
            self._credit[b.id] = credit
            total += b.tflops
            if credit > best:
                best_i, best = i, credit
        chosen = candidates[best_i]
        self._credit[chosen.id] -= total
        costs = tuple(CostTerms(b.id, 0.0, 0.0, 0.0, -self._credit[b.id]) for b in candidates)
        return Decision(chosen, self.name, costs)
