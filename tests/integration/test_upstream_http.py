"""The lean upstream HTTP/1.1 client against real servers on loopback: keep-alive reuse, the connection
limit, stale connections, bodies by length, chunks and end of connection, and what is never reused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.clients.upstream_http import UpstreamClosed, UpstreamPool, UpstreamProtocolError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body; None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def reply(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    while (body := await read_request(reader)) is not None:
        writer.write(reply(b"echo:" + body))
        await writer.drain()


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()


@pytest.fixture
async def echo_server() -> AsyncIterator[Server]:
    async with Server(echo) as server:
        yield server


async def post(pool: UpstreamPool, body: bytes, settle_s: float = 0.0) -> bytes:
    """The reply's body; `settle_s`: wait that long after the head before reading it."""
    async with asyncio.timeout(5):
        resp = await pool.post("/v1/x", body, [("content-type", "text/plain")], connect_timeout_s=2)
        try:
            assert resp.status == 200
            if settle_s:
                await asyncio.sleep(settle_s)
            return await resp.read()
        finally:
            resp.release()


async def test_sequential_requests_share_one_keep_alive_connection(echo_server: Server) -> None:
    pool = UpstreamPool(echo_server.url, max_connections=4, idle_s=5)
    for i in range(5):
        assert await post(pool, b"%d" % i) == b"echo:%d" % i
    await pool.close()
    assert echo_server.connections == 1


async def test_concurrent_requests_stay_within_the_connection_limit(echo_server: Server) -> None:
    pool = UpstreamPool(echo_server.url, max_connections=2, idle_s=5)
    replies = await asyncio.gather(*(post(pool, b"%d" % i) for i in range(12)))
    await pool.close()
    assert replies == [b"echo:%d" % i for i in range(12)]
    assert echo_server.connections <= 2


async def test_an_idle_connection_past_its_keep_alive_is_not_reused(echo_server: Server) -> None:
    pool = UpstreamPool(echo_server.url, max_connections=4, idle_s=0.05)
    await post(pool, b"a")
    await asyncio.sleep(0.1)
    await post(pool, b"b")
    await pool.close()
    assert echo_server.connections == 2


async def test_a_stale_connection_closed_by_the_upstream_is_retried_on_a_new_one() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        body = await read_request(reader)
        writer.write(reply(b"ok:" + (body or b"")))
        await writer.drain()
        await read_request(reader)   # a second request on this connection: closed unanswered

    async with Server(one_per_connection) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        assert await post(pool, b"1") == b"ok:1"
        assert await post(pool, b"2") == b"ok:2"
        await pool.close()
    assert server.connections == 2


async def test_a_fresh_connection_closed_before_the_reply_is_an_error() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async with Server(hang_up) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        with pytest.raises(UpstreamClosed):
            await post(pool, b"x")
        await pool.close()
    assert server.connections == 1


async def test_chunked_and_connection_delimited_bodies() -> None:
    async def chunked_then_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"hel", b"lo ", b"world"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return   # closes: the next request needs a new connection
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with Server(chunked_then_eof) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        assert await post(pool, b"") == b"hello world"
        assert await post(pool, b"") == b"until the end"
        await pool.close()


async def test_a_body_that_came_in_pieces_before_it_is_read_is_read_whole() -> None:
    """`read()` takes a body already complete at once: every piece, in order, and the connection kept."""
    async def pieces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n")
            for piece in (b"hel", b"lo ", b"world"):
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(piece)
            await writer.drain()

    async with Server(pieces) as server:
        pool = UpstreamPool(server.url, max_connections=1, idle_s=5)
        for _ in range(2):   # the whole body arrives before the read, in three reads of the socket
            assert await post(pool, b"", settle_s=0.2) == b"hello world"
        await pool.close()
    assert server.connections == 1


async def test_a_body_left_unread_closes_its_connection() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()

    async with Server(stream) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        for _ in range(2):
            async with asyncio.timeout(5):
                resp = await pool.post("/v1/x", b"", [], connect_timeout_s=2)
                assert await resp.read_some() == b"first"
                resp.release()   # mid-body: the connection cannot serve another request
        await pool.close()
    assert server.connections == 2


async def test_cancelled_mid_body_the_connection_is_not_reused() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf ")
            await writer.drain()

    async with Server(slow) as server:
        pool = UpstreamPool(server.url, max_connections=1, idle_s=5)
        for _ in range(2):   # with one slot, the second request needs the first's slot freed
            with pytest.raises(TimeoutError):
                await post_with_timeout(pool, 0.2)
        await pool.close()
    assert server.connections == 2


async def post_with_timeout(pool: UpstreamPool, timeout_s: float) -> bytes:
    resp = await pool.post("/v1/x", b"", [], connect_timeout_s=2)
    try:
        async with asyncio.timeout(timeout_s):
            return await resp.read()
    finally:
        resp.release()


async def test_bytes_that_are_not_http_are_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with Server(garbage) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        with pytest.raises(UpstreamProtocolError):
            await post(pool, b"x")
        await pool.close()


async def test_nothing_listening_is_a_connection_error_and_frees_its_slot() -> None:
    async with Server(echo) as server:
        url = server.url
    pool = UpstreamPool(url, max_connections=1, idle_s=5)
    for _ in range(3):   # each failure reaches the connect again: the one slot was given back
        with pytest.raises(OSError):
            await post(pool, b"x")
    await pool.close()


async def test_the_until_bound_covers_the_head_the_body_and_the_wait_for_a_slot() -> None:
    """`post(..., until=)`: TimeoutError at that loop time whichever wait of the exchange it falls in (no
    answer, half a body read after the head, no free connection), and a timed-out connection is never
    reused."""
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while (body := await read_request(reader)) is not None:
            if body == b"head":
                await asyncio.sleep(10)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf ")   # the other half never comes
            await writer.drain()

    async with asyncio.timeout(10), Server(stall) as server:   # a bound that is not kept fails, not hangs
        pool = UpstreamPool(server.url, max_connections=1, idle_s=5)
        loop = asyncio.get_running_loop()
        for what in (b"head", b"body"):
            started = loop.time()
            with pytest.raises(TimeoutError):
                resp = await pool.post("/v1/x", what, [], connect_timeout_s=2, until=started + 0.2)
                try:
                    await resp.read()   # no bound of its own: the exchange's
                finally:
                    resp.release()
            assert 0.15 < loop.time() - started < 2
        # the one slot is held by a stalled response: the next request waits for it until its bound
        resp = await pool.post("/v1/x", b"body", [], connect_timeout_s=2, until=loop.time() + 2)
        started = loop.time()
        with pytest.raises(TimeoutError):
            await pool.post("/v1/x", b"body", [], connect_timeout_s=2, until=started + 0.2)
        assert 0.15 < loop.time() - started < 2
        resp.release()
        await pool.close()
    assert server.connections == 3   # none of the timed-out connections served a second request


async def test_concurrent_bounded_exchanges_each_time_out_at_their_own_deadline() -> None:
    """The pool keeps one timer for all its bounded exchanges: one added later with an earlier deadline
    still times out at its own, and the others at theirs, not at the first one's."""
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    async with asyncio.timeout(10), Server(never) as server:
        pool = UpstreamPool(server.url, max_connections=4, idle_s=5)
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def bounded(after_s: float) -> float:
            with pytest.raises(TimeoutError):
                await pool.post("/v1/x", b"x", [], connect_timeout_s=2, until=started + after_s)
            return loop.time() - started

        ended = await asyncio.gather(bounded(0.6), bounded(0.2), bounded(0.4))
        for after_s, at in zip((0.6, 0.2, 0.4), ended, strict=True):
            assert after_s - 0.01 <= at < after_s + 1.0, (after_s, at)   # loosely above: a loaded machine
        assert ended[1] < ended[2] < ended[0], ended   # each at its own deadline, not another's
        await pool.close()


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="not an http"):
        UpstreamPool("grpc://127.0.0.1:1", max_connections=1, idle_s=1)
