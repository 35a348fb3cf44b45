"""The leader lease on the real Redis: one replica supervises, another takes over only once the lease
has expired and the old engines are silent, a Redis restart leaves the incumbent in charge."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config.sections import RedisConfig
from gateway.replicas.leadership import LOST, MISSING, RENEWED, LeaderLease, Supervision
from gateway.replicas.shared_state import connect
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix

pytestmark = pytest.mark.timeout(30)
LEASE_MS = 600


class Engines:
    """Stands in for the supervisor (the thing gated here is when it starts and stops)."""

    running: int = 0    # sets of engines running at once, over every instance

    def __init__(self) -> None:
        self.started = self.stopped = self.left = False

    def start(self) -> None:
        Engines.running += 1
        self.started = True

    async def stop(self) -> None:
        Engines.running -= 1
        self.stopped = True

    async def leave(self) -> None:   # still running, adopted by the next leader: not a set of their own
        Engines.running -= 1
        self.left = True


async def test_lease_is_exclusive_renewed_by_its_holder_only_and_retaken_when_missing() -> None:
    with redis_prefix("lease") as prefix:
        redis = connect(RedisConfig(), SYSTEM_REDIS)
        a = LeaderLease(redis, prefix + "leader", "a", LEASE_MS, 1.0)
        b = LeaderLease(redis, prefix + "leader", "b", LEASE_MS, 1.0)
        try:
            assert await a.acquire() and not await b.acquire()
            assert await a.renew() == RENEWED and await b.renew() == LOST
            await redis.delete(a.key)          # what a restarted Redis looks like
            assert await a.renew() == MISSING
            await b.release()                  # not the holder: nothing happens
            assert await a.acquire() and await a.current() == "a"
        finally:
            await redis.aclose()


async def test_only_one_replica_supervises_and_the_other_takes_over_when_it_stops() -> None:
    with redis_prefix("supervision") as prefix:
        redis = connect(RedisConfig(), SYSTEM_REDIS)
        made: dict[str, list[Engines]] = {"a": [], "b": []}
        silent = {"value": True}

        def supervision(name: str) -> Supervision:
            def make(adopted: object) -> Engines:
                made[name].append(Engines())
                return made[name][-1]
            lease = LeaderLease(redis, prefix + "leader", name, LEASE_MS, 1.0)
            return Supervision(make, lease, lambda adopted: silent["value"], takeover_wait_s=5.0,
                               clock=time.monotonic)

        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        a, b = supervision("a"), supervision("b")
        run_a = asyncio.create_task(a.run(stop_a))
        await asyncio.sleep(0.1)
        run_b = asyncio.create_task(b.run(stop_b))
        try:
            await asyncio.sleep(1.0)   # several renewals
            assert a.leading and not b.leading and Engines.running == 1
            run_a.cancel()             # a dies without releasing; its engines are still heartbeating
            silent["value"] = False
            for _ in range(100):       # the lease expires, b takes it
                if await redis.get(prefix + "leader") == "b":
                    break
                await asyncio.sleep(0.05)
            assert await redis.get(prefix + "leader") == "b"
            await asyncio.sleep(0.3)
            assert not b.leading       # b holds the lease, but the old engines are not silent yet
            Engines.running -= 1       # the orphans exit
            silent["value"] = True
            for _ in range(40):
                if b.leading:
                    break
                await asyncio.sleep(0.05)
            assert b.leading and Engines.running == 1
        finally:
            stop_b.set()
            await run_b
            await redis.aclose()
        assert made["b"][0].stopped and lease_free(prefix)


@pytest.mark.parametrize("peer_seen", [True, False])
async def test_a_leader_that_stops_hands_its_engines_over_only_to_a_replica_it_sees(peer_seen: bool) -> None:
    """Stopped while another replica is there to adopt them, the leader leaves its engines running (they
    served that replica's requests, which failed when it stopped them) and frees the lease; the last
    replica stops them."""
    with redis_prefix("handover") as prefix:
        redis = connect(RedisConfig(), SYSTEM_REDIS)
        made: list[Engines] = []

        def make(adopted: object) -> Engines:
            made.append(Engines())
            return made[-1]

        lease = LeaderLease(redis, prefix + "leader", "a", LEASE_MS, 1.0)
        async def hand_over() -> bool:
            return peer_seen

        leader = Supervision(make, lease, lambda adopted: True, takeover_wait_s=5.0, clock=time.monotonic,
                             hand_over=hand_over)
        stop = asyncio.Event()
        running = asyncio.create_task(leader.run(stop))
        try:
            for _ in range(40):
                if leader.leading:
                    break
                await asyncio.sleep(0.05)
            assert leader.leading
        finally:
            stop.set()
            await running
            await redis.aclose()
        (engines,) = made
        assert (engines.left, engines.stopped) == ((True, False) if peer_seen else (False, True))
        assert not leader.leading and lease_free(prefix)


def lease_free(prefix: str) -> bool:
    import redis as sync_redis

    with sync_redis.Redis.from_url(SYSTEM_REDIS) as r:
        return r.get(prefix + "leader") is None
