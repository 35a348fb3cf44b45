"""The gateway's pooled Redis client across a Redis restart (a private redis-server on 127.0.0.1).

Each pooled connection outlives the server it was opened to; with no retry at all, every one of them
failed once when next used, so seconds after Redis was back replicas logged `shared_state_down` again and
tenants with `on_redis_error: closed` got 503 while Redis answered."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.config.sections import RedisConfig
from gateway.replicas.shared_state import connect
from tests.replicas.redis_helpers import redis_server

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")]
CALLS = 8


async def test_every_pooled_connection_works_again_once_redis_is_back() -> None:
    with redis_server() as (url, port, first):
        client = connect(RedisConfig(url=url, timeout_ms=500), url)
        try:
            # concurrent calls: the pool holds a connection for each
            assert await asyncio.gather(*(client.set(f"k{i}", i) for i in range(CALLS))) == [True] * CALLS
            first.kill()
            first.wait()
            with pytest.raises(RedisConnectionError):   # down: one failure, at once (no hidden waits)
                await client.get("k0")
            with redis_server(port) as _:
                results = await asyncio.gather(*(client.set(f"k{i}", i) for i in range(CALLS)),
                                               return_exceptions=True)
                assert results == [True] * CALLS, results
        finally:
            await client.aclose()
