"""`Spreading`: a thin layer over any policy that keeps gateway replicas from herding.

Replicas that share state see the same snapshot until the next refresh, so for every request that
arrives between two refreshes they all rank the backends alike; each counts its own new dispatches at
once, but not the others', so the best backend gets up to N times the burst. This layer takes the
inner policy's decision and, when the chosen backend is the cheapest by the policy's own cost terms,
samples uniformly among the near-best:

    near(r) = { i : total(r, i) ≤ total(r, best) + tolerance · |total(r, best)| }
    choice  ~ Uniform(near(r))          (each replica has its own seeded RNG)

so the replicas pick differently inside the near-best set while the policy's ranking still decides
what is near-best. Reads: the decision's cost terms only, so it works over every policy, present or
future. Parameters: tolerance (relative, `gateway.redis.spread`), seed. Decisions that are not a cost
argmin (round robin, capacity-proportional, or no cost terms) pass through unchanged: those policies
spread by construction. A vetoed candidate (w3 ≫ the other terms) is never near-best. Limits: the
tolerance is relative, so it widens with queue length; with tolerance 0 only exact ties spread.
Only replicas use it: a single gateway routes with the bare policy. O(N), no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.routing.policies.contracts import BackendSnapshot, Decision, Policy, RequestProfile


class Spreading:
    def __init__(self, inner: Policy, tolerance: float, seed: int | str) -> None:
        self.inner = inner
        self.name = inner.name
        self.tolerance = tolerance
        self._rng = random.Random(seed)

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        decision = self.inner.choose(request, candidates, now)
        costs = decision.costs
        if len(costs) < 2:
            return decision
        best = decision.cost
        if any(c.total < best for c in costs):
            return decision
        limit = best + self.tolerance * abs(best)
        near = [c.backend_id for c in costs if c.total <= limit]
        if len(near) < 2:
            return decision
        pick = near[self._rng.randrange(len(near))]
        if pick == decision.backend.id:
            return decision
        chosen = next(b for b in candidates if b.id == pick)
        return Decision(chosen, decision.policy, costs)
