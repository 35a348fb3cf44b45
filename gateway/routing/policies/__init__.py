"""Routing policies and their one registry.

Each policy is a class with a `name`, a pydantic `Params` model (unknown keys rejected) and a pure
`choose(request, candidates, now)`. `build_policy` is the only way the gateway and the simulator
make one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from common.errors import ConfigError
from gateway.routing.policies.batch_aware import BatchAware
from gateway.routing.policies.capacity_proportional import CapacityProportional
from gateway.routing.policies.contracts import Policy
from gateway.routing.policies.encode_cost import EncodeCost
from gateway.routing.policies.heteroserve import HeteroServe
from gateway.routing.policies.least_image_tokens import LeastImageTokens
from gateway.routing.policies.least_outstanding import LeastOutstanding
from gateway.routing.policies.marginal_delay import MarginalDelay
from gateway.routing.policies.power_of_two import PowerOfTwo
from gateway.routing.policies.round_robin import RoundRobin
from gateway.routing.policies.shortest_queue import ShortestQueue

REGISTRY: dict[str, Any] = {
    cls.name: cls
    for cls in (
        HeteroServe, RoundRobin, ShortestQueue, CapacityProportional, PowerOfTwo, BatchAware, MarginalDelay,
        LeastOutstanding,
        EncodeCost, LeastImageTokens,  # vision pool
    )
}


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}") from None
    try:
        parsed = cls.Params.model_validate(dict(params or {}))
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"policy {name!r} parameters: {bad}") from None
    policy: Policy = cls(parsed)
    return policy
