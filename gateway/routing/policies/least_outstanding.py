"""`least_outstanding`: the fewest requests in flight per unit of capacity (capacity-weighted least-outstanding).

    cost(i) = (n_i + 1) / w_i        n_i: requests in flight on i from this gateway; w_i: its weight

(ties: the first candidate). What a 100-line proxy in front of a mixed cluster does, and the baseline
the routing benchmarks measure every policy against (benchmarks/routing_family.py,
benchmarks/lor_proxy.py). With `weights` each backend's capacity (e.g. the requests/s it sustains
alone, measured), faster tiers take proportionally more requests in flight; without, it is plain
least-outstanding. Reads in_flight. Parameters: weights (backend id → weight > 0; 1 where not
given). Limits: blind to request length, to prefill against decode speed and to KV use; the weights
are configured, not learned.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, PositiveFloat

from common.yaml_files import StrictModel
from gateway.routing.policies.candidates import first_lowest
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


class LeastOutstandingParams(StrictModel):
    weights: dict[str, PositiveFloat] = Field(default_factory=dict)


class LeastOutstanding:
    name = "least_outstanding"
    Params = LeastOutstandingParams

    def __init__(self, params: LeastOutstandingParams | None = None) -> None:
        self.weights = (params or LeastOutstandingParams()).weights

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        weights = self.weights
        totals = [(b.in_flight + 1) / weights.get(b.id, 1.0) for b in candidates]
        costs = tuple([CostTerms(b.id, 0.0, q, 0.0, q) for b, q in zip(candidates, totals, strict=True)])
        return Decision(candidates[first_lowest(totals)], self.name, costs)
