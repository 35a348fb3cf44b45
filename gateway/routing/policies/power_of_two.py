"""`power_of_two`: power-of-two-choices. Sample two distinct candidates, take the shorter queue.

Reads queue_depth. Parameter: seed (the RNG is the policy's own, so a run is reproducible).
Limits: like shortest_queue, blind to GPU capability.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from common.yaml_files import StrictModel
from gateway.routing.policies.contracts import BackendSnapshot, Decision, RequestProfile
from gateway.routing.policies.shortest_queue import queue_costs


class PowerOfTwoParams(StrictModel):
    seed: int = 0


class PowerOfTwo:
    name = "power_of_two"
    Params = PowerOfTwoParams

    def __init__(self, params: PowerOfTwoParams | None = None) -> None:
        self._rng = random.Random((params or PowerOfTwoParams()).seed)

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name, queue_costs(candidates))
        a, b = self._rng.sample(range(len(candidates)), 2)
        pair = (candidates[a], candidates[b])
        chosen = pair[1] if pair[1].queue_depth < pair[0].queue_depth else pair[0]
        return Decision(chosen, self.name, queue_costs(pair))
