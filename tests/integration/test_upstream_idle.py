"""The upstream pool closes the connections a burst left idle once `idle_s` has passed, without waiting
for another request: against a loopback server whose own keep-alive never ends, each would otherwise
stay open (a socket on both sides, a slot of the pool) until the next request came."""

from __future__ import annotations

import asyncio

from gateway.clients.upstream_http import UpstreamPool
from tests.integration.test_upstream_http import Server, echo, post


async def test_connections_left_idle_after_a_burst_are_closed_after_idle_s() -> None:
    closed = asyncio.Event()
    open_now = 0

    async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        nonlocal open_now
        open_now += 1
        try:
            await echo(reader, writer, n)   # until the client closes the connection
        finally:
            open_now -= 1
            if open_now == 0:
                closed.set()

    async with Server(counting) as server:
        pool = UpstreamPool(server.url, max_connections=8, idle_s=0.2)
        try:
            replies = await asyncio.gather(*(post(pool, b"%d" % i, settle_s=0.05) for i in range(4)))
            assert replies == [b"echo:%d" % i for i in range(4)] and server.connections > 1
            async with asyncio.timeout(10):   # no other request: only the pool's own timer closes them
                await closed.wait()
            assert await post(pool, b"again") == b"echo:again"   # a new connection serves the next one
        finally:
            await pool.close()
