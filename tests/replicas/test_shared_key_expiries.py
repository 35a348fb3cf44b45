"""Every key the replicas write to the real Redis expires once nobody rewrites it, with the limits the
config gives (gateway/replicas/shared_state.py, "Expiries"); the config refuses limits that disagree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config.sections import RedisConfig
from gateway.control.engine_identities import EngineIdentities, digest
from gateway.replicas.leadership import RENEWED, LeaderLease
from gateway.routing.backend_entry import Reported
from tests.replicas.redis_helpers import redis_prefix
from tests.replicas.test_shared_prefix_index import PROMPT, replica, route

pytestmark = pytest.mark.timeout(30)


async def test_members_engines_port_and_prefix_stream_expire_with_their_configured_ttls() -> None:
    with redis_prefix("expiries") as prefix:
        async with replica(prefix, "a", replica_ttl_ms=700, engine_keys_ttl_s=40,
                           prefix_stream_ttl_s=30) as (shared, index):
            redis = shared._redis
            assert await shared.engines_port(lambda: 45678) == 45678
            route(index, PROMPT, "l40s-0")
            await shared.refresh()
            assert 0 < await redis.pttl(shared.members_key) <= 700
            assert 0 < await redis.pttl(prefix + "engines_port") <= 40_000
            assert 0 < await redis.pttl(prefix + "prefix") <= 30_000
            # a Redis that lost the port gets it back, with its expiry, from the next refresh
            await redis.delete(prefix + "engines_port")
            await shared.refresh()
            assert await redis.get(prefix + "engines_port") == "45678"
            assert 0 < await redis.pttl(prefix + "engines_port") <= 40_000
            await shared.withdraw()


async def test_a_heartbeat_published_late_keeps_its_age_and_one_no_longer_fresh_is_not_published() -> None:
    """Redis away: heartbeats taken meanwhile are published on the first refresh that succeeds; the
    other replicas must read their real age, not take them for news."""
    with redis_prefix("late") as prefix:
        async with replica(prefix, "a") as (shared, _):
            t = shared.table
            ttl_ms = round(t.miss_limit * t.heartbeat_interval_s * 1000)
            for backend_id in ("h100-0", "l40s-0"):
                assert shared.heartbeat(backend_id, 1, "127.0.0.1:7001", Reported(seq=1))
            fresh, old = t.get("h100-0"), t.get("l40s-0")
            assert fresh is not None and old is not None and fresh.last_heartbeat is not None
            fresh.last_heartbeat -= t.heartbeat_interval_s   # received one interval ago
            old.last_heartbeat = t.clock() - 10              # received long ago
            await shared.refresh()
            assert 0 < await shared._redis.pttl(prefix + "hb:h100-0") <= ttl_ms - t.heartbeat_interval_s * 1000
            assert await shared._redis.exists(prefix + "hb:l40s-0") == 0
            await shared.withdraw()


async def test_the_leaders_announced_identities_replace_the_hash_and_expire() -> None:
    with redis_prefix("identities-ttl") as prefix:
        async with replica(prefix, "a") as (shared, _):
            redis = shared._redis
            await redis.hset(shared.identities_key, mapping={"gone-0": "digest of a backend no longer managed"})
            announced = {"h100-0": "d1", "l40s-0": "d2"}
            lease = LeaderLease(redis, prefix + "leader", "a", 1000, 1.0, shared.identities_key, announced,
                                announce_ttl_ms=50_000)
            assert await lease.acquire()
            assert await lease.renew() == RENEWED
            assert await redis.hgetall(shared.identities_key) == announced
            assert 0 < await redis.pttl(shared.identities_key) <= 50_000
            # a replica that does not hold the lease writes nothing
            other = LeaderLease(redis, prefix + "leader", "b", 1000, 1.0, shared.identities_key, {"h100-0": "x"})
            await other.renew()
            assert await redis.hgetall(shared.identities_key) == announced
            await lease.release()


async def test_a_backend_forgotten_leaves_the_announcement_with_the_next_renewal_and_the_last_takes_the_hash() -> None:
    """Removed from the fleet (`EngineIdentities.forget`), a managed backend's digest is no longer announced; once
    none is left the renewal deletes the hash rather than leaving the last digests until their expiry. A lease
    announcing nothing (no announce key) renews as before."""
    with redis_prefix("identities-forget") as prefix:
        async with replica(prefix, "a") as (shared, _):
            redis = shared._redis
            identities = EngineIdentities.drawn(["h100-0", "l40s-0"])
            lease = LeaderLease(redis, prefix + "leader", "a", 1000, 1.0, shared.identities_key, identities.announced)
            assert await lease.acquire() and await lease.renew() == RENEWED
            assert set(await redis.hgetall(shared.identities_key)) == {"h100-0", "l40s-0"}
            identities.forget("h100-0")
            assert await lease.renew() == RENEWED
            assert await redis.hgetall(shared.identities_key) == {"l40s-0": digest(identities.secret("l40s-0"))}
            identities.forget("l40s-0")
            assert "l40s-0" not in identities and not identities.verify("l40s-0", "")
            assert await lease.renew() == RENEWED
            assert await redis.exists(shared.identities_key) == 0
            await lease.release()
            silent = LeaderLease(redis, prefix + "leader", "a", 1000, 1.0)
            assert await silent.acquire() and await silent.renew() == RENEWED
            assert 0 < await redis.pttl(prefix + "leader") <= 1000
            await silent.release()


@pytest.mark.parametrize("settings", [
    {"held_check_interval_s": 0.5, "held_check_timeout_s": 1.0},   # two checks of one backend at once
    {"engine_orphan_s": 10, "engine_keys_ttl_s": 10},               # engines outliving replicas unfound
    {"leader_lease_ms": 5000, "engine_keys_ttl_s": 12},             # shorter than a gap between leaders
    {"held_check_failures": 0},
    {"prefix_stream_ttl_s": 0},
])
def test_limits_that_disagree_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        RedisConfig(**settings)  # type: ignore[arg-type]
