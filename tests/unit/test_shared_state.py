"""Shared state through the real Redis: heartbeats and in-flight counts cross replicas, a silent
replica's counts expire, and Redis away means each replica fails open on its own view."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import RedisError

from gateway.routing.backend_entry import Reported
from testkit.harness import free_port
from tests.replicas.redis_helpers import redis_prefix, replica, table

pytestmark = pytest.mark.timeout(30)
GPUS = {"h100-0": "H100", "l40s-0": "L40S"}


async def test_heartbeat_received_by_one_replica_reaches_the_other() -> None:
    with redis_prefix("hb") as prefix:
        a, b = table(GPUS), table(GPUS)
        async with replica(a, prefix, "a") as ra, replica(b, prefix, "b") as rb:
            assert ra.heartbeat("h100-0", 7, "127.0.0.1:7001", Reported(seq=7, waiting=3, running=2,
                                                                         kv_free_bytes=10, kv_total_bytes=20))
            await ra.refresh()
            await rb.refresh()
            entry = b.get("h100-0")
            assert entry is not None and b.is_healthy(entry)
            assert (entry.address, entry.reported.waiting, entry.reported.running) == ("127.0.0.1:7001", 3, 2)
            assert [s.id for s in b.candidates(("language",))] == ["h100-0"]
            # the heartbeat's age comes from its key's TTL: never in the future
            assert entry.last_heartbeat is not None and entry.last_heartbeat <= time.monotonic()


async def test_in_flight_counts_add_up_across_replicas_and_own_dispatches_count_at_once() -> None:
    with redis_prefix("inflight") as prefix:
        a, b = table(GPUS), table(GPUS)
        for t in (a, b):
            t.apply_heartbeat("h100-0", 1, "x:1", Reported(seq=1, kv_free_bytes=1 << 40, kv_total_bytes=1 << 40))
        async with replica(a, prefix, "a") as ra, replica(b, prefix, "b") as rb:
            for _ in range(3):
                a.acquire("h100-0")
            b.acquire("h100-0")
            for _ in range(3):   # a replica reads the members it learnt at its previous refresh
                await ra.refresh()
                await rb.refresh()
            assert b.candidates(("language",))[0].in_flight == 4
            assert a.candidates(("language",))[0].queue_depth == 4
            b.acquire("h100-0")   # between refreshes: b's own new dispatch counts at once
            assert b.candidates(("language",))[0].in_flight == 5
            assert ra.peer_count == 1 and rb.peer_count == 1


async def test_leases_prefill_backlog_and_kv_reservations_add_up_across_replicas() -> None:
    """What marginal_delay reads beside the in-flight count: requests before their first token, their
    prompt tokens, and KV reservations, summed over the replicas; and the tokens ahead that a
    request's TTFT teaches the prefill rate with."""
    with redis_prefix("leases") as prefix:
        a, b = table(GPUS), table(GPUS)
        for t in (a, b):
            t.apply_heartbeat("h100-0", 1, "x:1", Reported(seq=1, kv_free_bytes=1 << 40, kv_total_bytes=1 << 40))
        async with replica(a, prefix, "a") as ra, replica(b, prefix, "b") as rb:
            first = a.acquire("h100-0", prompt_tokens=1000, max_tokens=100)
            a.acquire("h100-0", prompt_tokens=500, max_tokens=50)
            a.first_token(first)
            b.acquire("h100-0", prompt_tokens=200, max_tokens=20)
            for _ in range(3):   # as above: the members learnt at the previous refresh
                await ra.refresh()
                await rb.refresh()
            for t in (a, b):
                snap = t.candidates(("language",))[0]
                assert (snap.in_flight, snap.prefilling, snap.prefill_backlog_tokens, snap.kv_reserved_tokens) == \
                    (3, 2, 700, 1870), snap
            # the prefill-rate sample of b's next request counts the tokens ahead of it on every replica
            assert b.acquire("h100-0", prompt_tokens=100).tokens_ahead == 800


async def test_a_replica_that_stops_refreshing_drops_out_after_its_ttl() -> None:
    with redis_prefix("expiry") as prefix:
        a, b = table(GPUS), table(GPUS)
        async with replica(a, prefix, "a", replica_ttl_ms=800) as ra, replica(b, prefix, "b") as rb:
            a.acquire("l40s-0")
            for _ in range(3):
                await ra.refresh()
                await rb.refresh()
            entry = b.get("l40s-0")
            assert entry is not None and entry.peer_in_flight == 1
            await asyncio.sleep(1.0)   # a is silent past its TTL
            await rb.refresh()
            assert entry.peer_in_flight == 0 and rb.peer_count == 0
            await rb.refresh()         # and is pruned from the members
            assert "a" not in await rb._redis.smembers(rb.members_key)


async def test_redis_away_fails_open_and_keeps_backends_heard_through_it() -> None:
    with redis_prefix("down") as prefix:
        a, b = table(GPUS), table(GPUS)
        async with replica(a, prefix, "a") as ra, replica(b, prefix, "b") as rb:
            ra.heartbeat("h100-0", 1, "x:1", Reported(seq=1))
            a.acquire("h100-0")
            for _ in range(3):
                await ra.refresh()
                await rb.refresh()
            assert b.get("h100-0").peer_in_flight == 1   # type: ignore[union-attr]
        dead_url = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
        async with replica(b, prefix, "b", url=dead_url, timeout_ms=100) as down:
            down._remote = rb._remote   # the same replica, its Redis gone
            with pytest.raises(RedisError):
                await down.refresh()
            down.failed(ConnectionError("refused"))
            entry = b.get("h100-0")
            assert entry is not None and not down.up and entry.peer_in_flight == 0
            entry.last_heartbeat = b.clock() - 10   # long silent: still assumed alive while Redis is away
            down.failed(ConnectionError("refused"))
            assert [s.id for s in b.candidates(("language",))] == ["h100-0"]


async def test_peers_on_a_host_are_told_by_their_replica_ids() -> None:
    """A leader hands its engines only to a replica on its host (one that shares the engines' port)."""
    from gateway.replicas.replica import new_replica_id

    here = new_replica_id()
    host = here.rsplit("-", 2)[0]
    with redis_prefix("peers-on") as prefix:
        async with replica(table({"h": "H100"}), prefix, here) as me, \
                replica(table({"h": "H100"}), prefix, "other-host-1-abcdef") as there, \
                replica(table({"h": "H100"}), prefix, new_replica_id()) as near:
            for r in (me, there, near, me, me):   # a peer counts from the refresh after the one that saw it
                await r.refresh()
            assert me.peer_count == 2 and me.peers_on(host) == 1 and me.peers_on("other-host") == 1
