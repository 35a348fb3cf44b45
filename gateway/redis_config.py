"""`gateway.redis`: how replicas share state through Redis (absent `url`: one process, state in memory)."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from heterogate.yaml_files import StrictModel


class RedisConfig(StrictModel):
    url: str | None = None                # redis://host:6379/0; `--redis-url` overrides
    key_prefix: str = Field(default="heterogate:", min_length=1)   # every key this deployment writes
    refresh_ms: PositiveInt = Field(default=50, le=1000)    # one pipelined round trip per refresh
    replica_ttl_ms: PositiveInt = 600     # a replica's in-flight counts outlive its last refresh this long
    timeout_ms: PositiveInt = 250         # connect and read timeout of every Redis call
    spread: float = Field(default=0.05, ge=0, le=1)   # near-best tolerance of the spreading layer (relative)
    leader_lease_ms: PositiveInt = Field(default=3000, ge=300)   # managed engines' supervisor lease
    fail_open_hold_s: PositiveFloat = 60.0   # Redis down: backends last heard through it stay assumed alive
