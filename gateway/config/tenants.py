"""`gateway.tenants`: which API keys belong to which tenant (a team), and each tenant's share and limits.

    gateway:
      tenants:
        on_redis_error: open          # limits kept in Redis and Redis away: admit (open) or 503 (closed)
        default: {weight: 1}          # keys of no tenant (gateway.auth's), and every request with keys off
        teams:
          search:
            api_keys_env: SEARCH_KEYS # or api_keys_file; as gateway.auth: never the key itself
            priority: 1               # a higher class is always admitted first under contention
            weight: 3                 # the share within its class
            min_in_flight: 4          # admitted past a saturated pool while fewer than this are under way
            requests_per_minute: 600
            tokens_per_minute: 200000 # prompt + completion, from the engines' usage
            tokens_per_day: 50000000

A tenant's keys are API keys: configuring one turns keys on for the /v1 routes, as gateway.auth's do.
Limits are fixed windows: a minute (from the whole minute) and a UTC day. Leaving a limit out leaves
it unlimited. A backend's `min_priority` (gateway.config.cluster.BackendSpec) keeps it for the
tenants of that class and above. The schema only: the keys are read by `gateway.config.auth.KeyRing`,
the limits applied by `gateway.pipeline.tenants`, the shares by the admission queue.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from common.yaml_files import StrictModel
from gateway.requests.job import DEFAULT_TENANT

TENANT_NAME = r"^[A-Za-z0-9._-]{1,64}$"   # a label value in /metrics and part of a Redis key
# Every number here is bounded. A limit is counted exactly by Redis's Lua (doubles: integers to 2^53) and
# written by /admin/usage (JSON of 64-bit integers: a larger one failed the whole reply with a 500); a weight
# divides each request's cost in the admission queue's tags, where an infinite one never advanced its
# tenant's tag (that tenant always first, the others of its class starved) and a denormal one overflowed
# them to inf and then NaN (fair queueing of the whole class gone).
# Strict: YAML's `true` (or `yes`, `on`) was a limit of 1 and "5" a limit of 5, where a number was meant.
WindowLimit = Annotated[int, Field(gt=0, le=2**53, strict=True)]
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31, strict=True)]
Weight = Annotated[float, Field(ge=1e-3, le=1e3, allow_inf_nan=False, strict=True)]


class TenantPolicy(StrictModel):
    """What a tenant gets: its priority class, its weight within the class, and its limits."""

    priority: Priority = 0            # strict between classes: any waiting request of a higher class goes first
    weight: Weight = 1.0              # weighted fair share among the tenants of one class
    # Requests admitted past a saturated pool while the tenant has fewer under way (its guaranteed
    # concurrency), unless a higher class waits; 0 (the default): none, every request waits its turn.
    min_in_flight: Annotated[int, Field(ge=0, strict=True)] = 0
    requests_per_minute: WindowLimit | None = None
    tokens_per_minute: WindowLimit | None = None   # prompt + completion tokens
    tokens_per_day: WindowLimit | None = None      # a daily budget, the UTC day


class TenantSpec(TenantPolicy):
    """A named tenant: its policy and where its API keys are (one key per line / comma-separated)."""

    api_keys_file: Path | None = None
    api_keys_env: str | None = Field(default=None, min_length=1)


class TenantsConfig(StrictModel):
    default: TenantPolicy = TenantPolicy()
    teams: dict[str, TenantSpec] = Field(default_factory=dict)
    # Redis unreachable (`--redis-url` given): `open` admits without counting (logged, counted in
    # heterogate_tenant_limiter_errors), `closed` answers 503 until Redis answers again.
    on_redis_error: Literal["open", "closed"] = "open"
    # Each tenant's prompts hit only its own cached prefixes: every request gets a prefix-cache salt
    # naming its tenant (vLLM's `cache_salt`, with the client's own after it), so no tenant can time
    # whether another sent a prompt lately. Hits across tenants are given up.
    isolate_prefix_cache: bool = False

    @property
    def classes(self) -> list[int]:
        """The priority classes of the tenants, lowest first."""
        return sorted({self.default.priority, *(t.priority for t in self.teams.values())})

    @field_validator("teams")
    @classmethod
    def _names_and_keys(cls, teams: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        for name, spec in teams.items():
            if not re.match(TENANT_NAME, name):
                raise ValueError(f"tenant name {name!r}: letters, digits, '.', '_' and '-' only, at most 64")
            if name == DEFAULT_TENANT:
                raise ValueError(f"{DEFAULT_TENANT!r} is the tenant of keys that name none: set it under "
                                 "gateway.tenants.default (it has no keys of its own)")
            if spec.api_keys_file is None and spec.api_keys_env is None:
                raise ValueError(f"tenant {name!r} has no api_keys_file or api_keys_env: no request could be its")
        return teams
