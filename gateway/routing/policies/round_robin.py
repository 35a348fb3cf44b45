"""`round_robin`: uniform dispatch, the paper's "Uniform" baseline.

Reads nothing but the candidate list. State: one counter. Limits: blind to capability and load.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile


class RoundRobinParams(StrictModel):
    pass


class RoundRobin:
    name = "round_robin"
    Params = RoundRobinParams

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self._next = 0

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(chosen, self.name, ())
