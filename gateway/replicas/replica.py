"""Joins one gateway process to the other replicas of its deployment through Redis.

Wires the pieces of scale-out into a runtime built for one process: the shared state (the runtime's
signal store becomes the Redis one, published and refreshed in the background, see shared_state.py),
the spreading layer over both pools' policies (policies/spreading.py), the leader lease that picks
the one replica running the managed engines (leadership.py), the engines' identities that every
replica checks (engine_identities.py) and the tenants' rate limits (tenant_limits.py). A process
without a Redis URL uses none of them, supervises the engines itself and keeps the tenants' limits
in memory.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from gateway.control.engine_identities import EngineIdentities
from gateway.control.launchers import free_port
from gateway.replicas.leadership import LeaderLease
from gateway.replicas.shared_state import SharedState, SharedStateCollector, connect
from gateway.replicas.tenant_limits import RedisLimitStore
from gateway.routing.policies.spreading import Spreading
from gateway.runtime import Runtime


def new_replica_id() -> str:
    """Unique per process and readable in Redis: host, pid and a random tail (pids repeat across hosts)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Replication:
    replica_id: str
    redis: Redis
    shared: SharedState
    lease: LeaderLease
    runtime: Runtime

    async def reachable(self, wait_s: float, retry_s: float = 0.5) -> None:
        """Redis answers within `wait_s`, else the last error (a replica that cannot reach it at start-up
        could never lead or launch, and would serve nothing). A refusal from Redis itself (a password
        missing or wrong, a database it does not have) is raised at once: waiting does not change it."""
        timeout_s = self.runtime.config.settings.redis.timeout_ms / 1000
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                await asyncio.wait_for(self.redis.ping(), timeout_s)
                return
            except (AuthenticationError, ResponseError):
                raise
            except (RedisError, OSError, TimeoutError):
                if loop.time() + retry_s >= deadline:
                    raise
            await asyncio.sleep(retry_s)

    async def engines_port(self, host: str) -> int:
        """The port on this host where every replica takes the managed engines' heartbeats (each binds
        it with SO_REUSEPORT, gateway/daemon.py), agreed through Redis (`SharedState.engines_port`)."""
        return await self.shared.engines_port(lambda: free_port(host))

    async def close(self) -> None:
        await self.redis.aclose()


def join(runtime: Runtime, url: str, identities: EngineIdentities) -> Replication:
    """`identities`: this replica's engine identities (announced while it leads, adopted otherwise)."""
    config = runtime.config.settings.redis
    replica_id = new_replica_id()
    redis = connect(config, url)
    shared = SharedState(runtime.table, redis, config, replica_id, on_heartbeat=runtime.clients.ensure,
                         on_identities=identities.adopt, prefixes=runtime.pipeline.prefixes,
                         encoders=runtime.pipeline.encoders)
    runtime.signals = shared   # the backends' reports go through Redis to the other replicas too
    runtime.metrics.registry.register(SharedStateCollector(shared))
    # tenants' limits hold across the replicas
    runtime.pipeline.tenants.store = RedisLimitStore(redis, config.key_prefix, config.timeout_ms / 1000)
    pipeline = runtime.pipeline
    pipeline.policy = Spreading(pipeline.policy, config.spread, seed=replica_id)
    pipeline.vision_policy = Spreading(pipeline.vision_policy, config.spread, seed=replica_id + "/vision")
    lease = LeaderLease(redis, config.key_prefix + "leader", replica_id, config.leader_lease_ms,
                        config.timeout_ms / 1000, shared.identities_key, identities.announced,
                        round(config.engine_keys_ttl_s * 1000))
    return Replication(replica_id, redis, shared, lease, runtime)

