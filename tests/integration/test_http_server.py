"""The front door's HTTP/1.1 server (gateway.doors.http_server) as a real server on loopback: raw sockets and
httpx against small handlers written here. Keep-alive and close, pipelining, `Expect: 100-continue`,
body and header limits, garbage, disconnects, the idle timeout, chunked streaming and write flow
control, the fallback handler of unrouted paths, handler errors, the drain on stop, and TLS."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import socket
import ssl
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.doors.http_server import MAX_HEADER_BYTES, MAX_PIPELINED, Exchange, HttpServer, Request
from tests.tls_certs import self_signed

pytestmark = pytest.mark.timeout(30)   # a backstop; every test also bounds its own waits

Handler = Callable[[Request, Exchange], Awaitable[None]]
IO_S = 5.0   # the longest any single read or connect may take


# -- the server under test ---------------------------------------------------------------------


async def not_found(request: Request, exchange: Exchange) -> None:
    exchange.respond(404, [], b"not found", b"text/plain")


async def ping(request: Request, exchange: Exchange) -> None:
    exchange.respond(200, [(b"x-path", request.path.encode())], b"pong", b"text/plain")


async def echo(request: Request, exchange: Exchange) -> None:
    exchange.respond(200, [], request.body, b"application/octet-stream")


@dataclass
class Served:
    server: HttpServer
    port: int


@asynccontextmanager
async def serve(routes: dict[str, Handler], fallback: Handler = not_found, *, max_body_bytes: int = 1 << 20,
                idle_s: float = 5.0, body_timeout_s: float = 5.0,
                ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Served]:
    """An HttpServer listening on 127.0.0.1:<free port>; stopped, with every task it started finished, on exit."""
    server = HttpServer(routes, fallback, max_body_bytes=max_body_bytes, idle_s=idle_s, body_timeout_s=body_timeout_s,
                        ssl_context=ssl_context)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await server.start(sock)
    try:
        yield Served(server, port)
    finally:
        await server.stop(0)
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        if others:
            await asyncio.wait(others, timeout=IO_S)


# -- a raw HTTP/1.1 client ---------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]          # lower-case names
    body: bytes
    chunks: list[bytes] | None = None    # the chunks as framed, when the body was chunked
    head: bytes = b""

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Conn:
        async with asyncio.timeout(IO_S):
            if rcvbuf is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            else:   # a small, fixed receive buffer: a client that does not read stops the sender soon
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def head(self) -> bytes:
        async with asyncio.timeout(IO_S):
            return await self.reader.readuntil(b"\r\n\r\n")

    async def response(self, *, head_only: bool = False) -> Response:
        """One response: by content-length, by chunks, or (neither) to the end of the connection."""
        async with asyncio.timeout(IO_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head[:-4].split(b"\r\n")
            version, status, *_ = status_line.split(b" ", 2)
            assert version == b"HTTP/1.1", status_line
            headers: dict[bytes, bytes] = {}
            for line in lines:
                name, _, value = line.partition(b":")
                assert name.lower() not in headers, f"duplicate header {name!r}"
                headers[name.lower()] = value.strip()
            if head_only:
                return Response(int(status), headers, b"", head=head)
            if headers.get(b"transfer-encoding") == b"chunked":
                assert b"content-length" not in headers
                chunks = []
                while True:
                    size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                    if size == 0:
                        assert await self.reader.readexactly(2) == b"\r\n"   # no trailers
                        return Response(int(status), headers, b"".join(chunks), chunks, head)
                    chunks.append(await self.reader.readexactly(size))
                    assert await self.reader.readexactly(2) == b"\r\n"
            if b"content-length" in headers:
                body = await self.reader.readexactly(int(headers[b"content-length"]))
                return Response(int(status), headers, body, head=head)
            return Response(int(status), headers, await self.reader.read(), head=head)

    async def closed(self, within: float = IO_S) -> bool:
        """True when the server closes the connection (FIN or reset) within `within` seconds with nothing
        more sent; False when it is still open then."""
        try:
            async with asyncio.timeout(within):
                rest = await self.reader.read()
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        assert rest == b"", f"unexpected bytes before the close: {rest[:200]!r}"
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            async with asyncio.timeout(IO_S):
                await self.writer.wait_closed()
        except (ConnectionError, TimeoutError):
            pass


def get(path: str, *extra: bytes, method: bytes = b"GET", version: bytes = b"HTTP/1.1") -> bytes:
    return b"%s %s %s\r\nhost: test\r\n%s\r\n" % (method, path.encode(), version, b"".join(h + b"\r\n" for h in extra))


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    return get(path, b"content-length: %d" % len(body), *extra, method=b"POST") + body


def assert_openai_error(response: Response, status: int) -> dict[str, Any]:
    assert response.status == status
    assert response.headers[b"content-type"] == b"application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert b"x-request-id" in response.headers
    return body["error"]  # type: ignore[no-any-return]


# -- keep-alive, close, pipelining ---------------------------------------------------------------


async def test_keep_alive_serves_two_requests_on_one_connection() -> None:
    async with serve({"/ping": ping, "/echo": echo}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/ping"))
        first = await conn.response()
        conn.send(post("/echo", b"second"))
        second = await conn.response()
        assert (first.status, first.body, first.headers[b"x-path"]) == (200, b"pong", b"/ping")
        assert (second.status, second.body) == (200, b"second")
        assert b"connection" not in first.headers and b"connection" not in second.headers
        assert b"date" in first.headers
        assert not await conn.closed(within=0.2)   # still open for a third
        assert len(s.server.connections) == 1
        await conn.close()


async def test_httpx_reuses_the_connection() -> None:
    async with serve({"/echo": echo}) as s, httpx.AsyncClient(timeout=IO_S) as client:
        for i in range(3):
            r = await client.post(f"http://127.0.0.1:{s.port}/echo", content=b"n%d" % i)
            assert (r.status_code, r.content) == (200, b"n%d" % i)
        assert len(s.server.connections) == 1


@pytest.mark.parametrize("request_bytes", [
    get("/ping", b"connection: close"),
    get("/ping", version=b"HTTP/1.0"),
], ids=["connection-close", "http-1.0"])
async def test_close_after_the_response_when_the_client_asks(request_bytes: bytes) -> None:
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(request_bytes)
        response = await conn.response()
        assert (response.status, response.body) == (200, b"pong")
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        await conn.close()


async def test_http_1_0_keep_alive_stays_open() -> None:
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        for _ in range(2):
            conn.send(get("/ping", b"connection: keep-alive", version=b"HTTP/1.0"))
            assert (await conn.response()).body == b"pong"
        await conn.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def slow(request: Request, exchange: Exchange) -> None:
        await asyncio.sleep(0.1)   # the second request is complete long before the first is answered
        exchange.respond(200, [], b"slow", b"text/plain")

    async with serve({"/slow": slow, "/echo": echo, "/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/slow") + post("/echo", b"fast") + get("/ping"))
        bodies = [(await conn.response()).body for _ in range(3)]
        assert bodies == [b"slow", b"fast", b"pong"]
        assert not await conn.closed(within=0.1)
        await conn.close()


async def test_a_long_pipeline_is_served_past_the_queue_cap() -> None:
    """More pipelined requests than MAX_PIPELINED, the rest arriving while the queue is full: reading
    pauses, and resumes as the queue empties, so every request is answered."""
    async def slow(request: Request, exchange: Exchange) -> None:
        await asyncio.sleep(0.005)
        exchange.respond(200, [], request.query, b"text/plain")

    first, second = MAX_PIPELINED + 4, MAX_PIPELINED + 4
    async with serve({"/slow": slow}) as s:
        conn = await Conn.open(s.port)
        conn.send(b"".join(get(f"/slow?{i}") for i in range(first)))
        await asyncio.sleep(0.02)   # the first batch is queued and reading is paused
        conn.send(b"".join(get(f"/slow?{i}") for i in range(first, first + second)))
        bodies = [(await conn.response()).body for _ in range(first + second)]
        assert bodies == [b"%d" % i for i in range(first + second)]
        await conn.close()


async def test_nothing_is_served_after_a_response_that_closes_the_connection() -> None:
    """A `connection: close` request followed in the same send by another: the first is answered with
    `connection: close`, the second never (RFC 9112 §9.6)."""
    served: list[str] = []

    async def record(request: Request, exchange: Exchange) -> None:
        served.append(request.path)
        exchange.respond(200, [], b"ok", b"text/plain")

    async with serve({"/a": record, "/b": record}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/a", b"connection: close") + get("/b"))
        response = await conn.response()
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        assert served == ["/a"]
        await conn.close()


# -- Expect: 100-continue ----------------------------------------------------------------------


async def test_expect_100_continue_before_the_body() -> None:
    bodies: list[bytes] = []

    async def take(request: Request, exchange: Exchange) -> None:
        bodies.append(request.body)
        exchange.respond(200, [], b"got %d" % len(request.body), b"text/plain")

    async with serve({"/upload": take}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/upload", b"content-length: 11", b"expect: 100-continue", method=b"POST"))
        assert await conn.head() == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert bodies == []
        conn.send(b"hello world")
        response = await conn.response()
        assert (response.status, response.body) == (200, b"got 11")
        assert bodies == [b"hello world"]
        await conn.close()


async def test_no_100_continue_in_the_middle_of_another_response() -> None:
    """A pipelined `Expect: 100-continue` request behind one still being answered: the interim response
    must not land before (or inside) the earlier request's response."""
    release = asyncio.Event()

    async def slow(request: Request, exchange: Exchange) -> None:
        await release.wait()
        exchange.respond(200, [], b"first", b"text/plain")

    async with serve({"/slow": slow, "/echo": echo}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/slow") + get("/echo", b"content-length: 4", b"expect: 100-continue", method=b"POST"))
        await asyncio.sleep(0.1)
        release.set()
        head = await conn.head()
        assert head.startswith(b"HTTP/1.1 200 "), head   # the first response comes first, whole
        assert (await _rest_after(conn, head)).body == b"first"
        conn.send(b"body")   # the client's expect timer ran out: it sends the body anyway
        head = await conn.head()
        if head == b"HTTP/1.1 100 Continue\r\n\r\n":   # allowed once the first response is complete
            head = await conn.head()
        second = await _rest_after(conn, head)
        assert (second.status, second.body) == (200, b"body")
        await conn.close()


async def _rest_after(conn: Conn, head: bytes) -> Response:
    """The rest of a content-length response whose head was read already."""
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in head[:-4].split(b"\r\n")[1:])}
    async with asyncio.timeout(IO_S):
        body = await conn.reader.readexactly(int(headers[b"content-length"]))
    return Response(int(head.split(b" ")[1]), headers, body, head=head)


# -- limits and garbage ------------------------------------------------------------------------


async def test_declared_body_over_the_limit_gets_413_and_a_close() -> None:
    called: list[str] = []

    async def never(request: Request, exchange: Exchange) -> None:
        called.append(request.path)
        exchange.respond(200, [], b"", b"text/plain")

    async with serve({"/echo": never}, max_body_bytes=1000) as s:
        conn = await Conn.open(s.port)
        # the body is never sent: the refusal comes on the headers alone, before any 100 Continue
        conn.send(get("/echo", b"content-length: 1001", b"expect: 100-continue", b"x-request-id: req-413",
                      method=b"POST"))
        response = await conn.response()
        error = assert_openai_error(response, 413)
        assert error["type"] == "invalid_request_error" and error["code"] == "payload_too_large"
        assert "1001" in error["message"] and "1000" in error["message"]
        assert response.headers[b"x-request-id"] == b"req-413"
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        assert called == []
        await conn.close()


async def test_chunked_body_growing_over_the_limit_gets_413_and_a_close() -> None:
    called: list[str] = []

    async def never(request: Request, exchange: Exchange) -> None:
        called.append(request.path)

    async with serve({"/echo": never}, max_body_bytes=1000) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/echo", b"transfer-encoding: chunked", method=b"POST")
                  + b"258\r\n" + b"a" * 600 + b"\r\n" + b"258\r\n" + b"b" * 600 + b"\r\n")
        response = await conn.response()
        error = assert_openai_error(response, 413)
        assert error["code"] == "payload_too_large" and "1000" in error["message"]
        assert len(response.headers[b"x-request-id"]) == 32   # none given: a fresh one
        assert await conn.closed()
        assert called == []
        await conn.close()


async def test_bodies_at_the_limit_are_served() -> None:
    async with serve({"/echo": echo}, max_body_bytes=1000) as s:
        conn = await Conn.open(s.port)
        conn.send(post("/echo", b"x" * 1000))
        assert (await conn.response()).body == b"x" * 1000
        conn.send(get("/echo", b"transfer-encoding: chunked", method=b"POST")
                  + b"1f4\r\n" + b"y" * 500 + b"\r\n" + b"1f4\r\n" + b"z" * 500 + b"\r\n0\r\n\r\n")
        assert (await conn.response()).body == b"y" * 500 + b"z" * 500
        assert not await conn.closed(within=0.1)
        await conn.close()


async def test_header_block_over_the_cap_gets_431() -> None:
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        filler = [b"x-filler-%d: %s" % (i, b"f" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 2)]
        conn.send(get("/ping", *filler))
        response = await conn.response()
        error = assert_openai_error(response, 431)
        assert error["type"] == "invalid_request_error"
        assert await conn.closed()
        await conn.close()

        # just under the cap is served
        conn = await Conn.open(s.port)
        conn.send(get("/ping", *filler[: MAX_HEADER_BYTES // 1000 - 8]))
        assert (await conn.response()).status == 200
        await conn.close()


async def test_request_line_over_the_cap_gets_414() -> None:
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/ping?q=" + "q" * (MAX_HEADER_BYTES + 10)))
        assert_openai_error(await conn.response(), 414)
        assert await conn.closed()
        await conn.close()


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",   # a TLS hello on plain HTTP
    b"HELLO WORLD\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: a\r\ncontent-length: nope\r\n\r\n",
], ids=["tls-hello", "not-http", "bad-content-length"])
async def test_garbage_gets_400_json_and_a_close(garbage: bytes) -> None:
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/ping"))   # a good request first: the connection is past its first message
        assert (await conn.response()).status == 200
        conn.send(garbage)
        response = await conn.response()
        assert_openai_error(response, 400)
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        await conn.close()

        conn = await Conn.open(s.port)   # the server itself is fine
        conn.send(get("/ping"))
        assert (await conn.response()).status == 200
        await conn.close()


@pytest.mark.parametrize("bad, status", [
    (b"HELLO WORLD\r\n\r\n", 400),
    (get("/slow", b"content-length: 5000", method=b"POST"), 413),
], ids=["garbage", "too-large"])
async def test_a_bad_request_pipelined_behind_good_ones(bad: bytes, status: int) -> None:
    """The requests read before the bad one are answered, in order; then the refusal; then the close."""
    async def slow(request: Request, exchange: Exchange) -> None:
        await asyncio.sleep(0.05)
        exchange.respond(200, [], b"slow", b"text/plain")

    async with serve({"/slow": slow, "/ping": ping}, max_body_bytes=1000) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/slow") + get("/ping") + bad)
        assert (await conn.response()).body == b"slow"
        assert (await conn.response()).body == b"pong"
        assert_openai_error(await conn.response(), status)
        assert await conn.closed()
        await conn.close()


# -- disconnects and idle connections ----------------------------------------------------------


class Hang:
    """A handler that waits until it is cancelled, recording whether the client was gone by then, or the
    gateway cut it (`answer_cut`: it then answers 503 itself, as the completion routes do)."""

    def __init__(self, answer_cut: bool = False) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.gone_when_cancelled: list[bool] = []
        self.cut_when_cancelled: list[bool] = []
        self.answer_cut = answer_cut

    async def __call__(self, request: Request, exchange: Exchange) -> None:
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.gone_when_cancelled.append(exchange.gone)
            self.cut_when_cancelled.append(exchange.cut)
            self.cancelled.set()
            if not (self.answer_cut and exchange.cut):
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            exchange.respond(503, [], b"shutting down", b"text/plain")
            return
        exchange.respond(200, [], b"too late", b"text/plain")


@pytest.mark.parametrize("request_bytes", [
    get("/hang"),
    get("/hang", b"connection: close"),
    get("/hang", version=b"HTTP/1.0"),
], ids=["keep-alive", "connection-close", "http-1.0"])
async def test_client_disconnect_cancels_the_handler(request_bytes: bytes) -> None:
    hang = Hang()
    async with serve({"/hang": hang, "/ping": ping}) as s:
        other = await Conn.open(s.port)   # a connection opened before, used after the disconnect
        other.send(get("/ping"))
        assert (await other.response()).status == 200

        conn = await Conn.open(s.port)
        conn.send(request_bytes)
        async with asyncio.timeout(IO_S):
            await hang.started.wait()
        await conn.close()
        async with asyncio.timeout(IO_S):
            await hang.cancelled.wait()
        assert hang.gone_when_cancelled == [True]

        other.send(get("/ping"))
        assert (await other.response()).body == b"pong"
        fresh = await Conn.open(s.port)
        fresh.send(get("/ping"))
        assert (await fresh.response()).body == b"pong"
        await other.close()
        await fresh.close()
        async with asyncio.timeout(IO_S):
            while len(s.server.connections) > 0:  # noqa: ASYNC110 (the server has no event for it)
                await asyncio.sleep(0.01)


async def test_idle_keep_alive_connection_is_closed_after_idle_s() -> None:
    async with serve({"/ping": ping}, idle_s=0.2) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/ping"))
        assert (await conn.response()).status == 200
        t0 = time.monotonic()
        assert await conn.closed(within=IO_S)
        assert 0.15 <= time.monotonic() - t0 < 4.0
        await conn.close()

        silent = await Conn.open(s.port)   # one that never sends a byte
        t0 = time.monotonic()
        assert await silent.closed(within=IO_S)
        assert 0.15 <= time.monotonic() - t0 < 4.0
        await silent.close()

    async with serve({"/ping": ping}, idle_s=0.6) as s:
        busy = await Conn.open(s.port)     # one that keeps asking is never idle for long enough
        t0 = time.monotonic()
        for _ in range(8):
            busy.send(get("/ping"))
            assert (await busy.response()).status == 200
            await asyncio.sleep(0.1)
        busy.send(get("/ping"))
        assert (await busy.response()).status == 200
        assert time.monotonic() - t0 > 0.6   # longer than idle_s in all, never idle that long
        await busy.close()


async def test_a_request_head_trickled_in_is_cut_at_idle_s() -> None:
    """The idle timer runs until a request's headers are complete: a client that sends half a head and
    then a byte now and then does not hold the connection."""
    async with serve({"/ping": ping}, idle_s=0.3) as s:
        conn = await Conn.open(s.port)
        t0 = time.monotonic()
        conn.send(b"GET /ping HTTP/1.1\r\nhost: x\r\n")
        for _ in range(4):
            await asyncio.sleep(0.1)
            conn.send(b"x-slow: 1\r\n")
        assert await conn.closed(within=IO_S)
        assert time.monotonic() - t0 < 4.0
        await conn.close()


@pytest.mark.parametrize("path", ["/ping", "/elsewhere"], ids=["route", "fallback"])
async def test_two_authorization_headers_get_400_and_a_close(path: str) -> None:
    """Readers of headers differ on which of two counts (the first, the last): neither is served."""
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get(path, b"Authorization: Bearer a", b"x-other: 1", b"AUTHORIZATION: Bearer b"))
        error = assert_openai_error(await conn.response(), 400)
        assert "Authorization" in error["message"]
        assert await conn.closed()
        await conn.close()

        conn = await Conn.open(s.port)   # one is fine, on every request of a connection
        for _ in range(2):
            conn.send(get("/ping", b"authorization: Bearer a"))
            assert (await conn.response()).status == 200
        await conn.close()


# -- bodies that stall -------------------------------------------------------------------------

BODY_TIMEOUT_S = 0.4
STALLED = {
    "short": post("/echo", b"x" * 100)[:-40],
    "no-final-chunk": get("/echo", b"transfer-encoding: chunked", method=b"POST") + b"5\r\nhello\r\n",
    "expect-no-body": get("/echo", b"content-length: 10", b"expect: 100-continue", method=b"POST"),
    "trickled": get("/echo", b"content-length: 1000", method=b"POST"),   # then a byte every 50 ms
}


async def _trickle(conn: Conn) -> None:
    with contextlib.suppress(ConnectionError):
        while True:
            await asyncio.sleep(0.05)
            conn.send(b"x")


@pytest.mark.parametrize("stalled", STALLED.values(), ids=STALLED.keys())
async def test_a_stalled_body_is_cut_with_408_and_others_are_served(stalled: bytes) -> None:
    """The body's deadline runs from the end of its headers (from the 100 Continue when one is sent)."""
    async with serve({"/echo": echo, "/ping": ping}, body_timeout_s=BODY_TIMEOUT_S) as s:
        conn = await Conn.open(s.port)
        t0 = time.monotonic()
        conn.send(stalled)
        if b"expect" in stalled:
            assert await conn.head() == b"HTTP/1.1 100 Continue\r\n\r\n"
        trickle = asyncio.create_task(_trickle(conn)) if stalled.endswith(b"\r\n\r\n") and b"expect" not in stalled \
            else None
        other = await Conn.open(s.port)   # served meanwhile
        other.send(get("/ping"))
        assert (await other.response()).body == b"pong"

        response = await conn.response()
        error = assert_openai_error(response, 408)
        assert "body" in error["message"]
        assert time.monotonic() - t0 >= BODY_TIMEOUT_S
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        if trickle is not None:
            trickle.cancel()
            await asyncio.gather(trickle, return_exceptions=True)
        await conn.close()

        other.send(post("/echo", b"after"))
        assert (await other.response()).body == b"after"
        await other.close()


async def test_a_body_that_comes_in_pieces_within_the_deadline_is_served() -> None:
    async with serve({"/echo": echo}, body_timeout_s=2.0) as s:
        conn = await Conn.open(s.port)
        body = b"y" * 30
        conn.send(get("/echo", b"content-length: 30", method=b"POST"))
        for i in range(3):
            await asyncio.sleep(0.05)
            conn.send(body[i * 10:(i + 1) * 10])
        assert (await conn.response()).body == body
        conn.send(post("/echo", b"next"))   # the connection goes on, back to its idle timeout
        assert (await conn.response()).body == b"next"
        await conn.close()


async def test_a_stalled_body_pipelined_behind_a_slow_request() -> None:
    """The response in flight is written whole; then the 408; then the close."""
    async def slow(request: Request, exchange: Exchange) -> None:
        await asyncio.sleep(2 * BODY_TIMEOUT_S)
        exchange.respond(200, [], b"slow", b"text/plain")

    async with serve({"/slow": slow, "/echo": echo}, body_timeout_s=BODY_TIMEOUT_S) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/slow") + STALLED["short"])
        assert (await conn.response()).body == b"slow"
        assert_openai_error(await conn.response(), 408)
        assert await conn.closed()
        await conn.close()


async def test_the_body_of_a_connection_that_closes_is_freed() -> None:
    """A half-read body is let go when its client leaves, not when the collector next finds the
    connection's cycle (the daemon's thresholds make full collections rare; here there is none)."""
    size = 4 << 20
    async with serve({"/echo": echo}, max_body_bytes=2 * size, body_timeout_s=IO_S) as s:
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            conns = [await Conn.open(s.port) for _ in range(3)]
            for conn in conns:
                conn.send(get("/echo", b"content-length: %d" % (size + 1), method=b"POST") + b"z" * size)
                await conn.writer.drain()
            async with asyncio.timeout(IO_S):
                while tracemalloc.get_traced_memory()[0] - before < 2 * size:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            for conn in conns:
                await conn.close()
            async with asyncio.timeout(IO_S):
                while s.server.connections:  # noqa: ASYNC110 (the server has no event for it)
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert tracemalloc.get_traced_memory()[0] - before < size // 2
        finally:
            tracemalloc.stop()
            gc.enable()


async def test_an_endless_header_line_gets_431() -> None:
    """httptools holds a header line until it ends; the server caps the bytes of a head as they come."""
    async with serve({"/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(b"GET /ping HTTP/1.1\r\nx-long: ")
        for _ in range(40):
            conn.send(b"a" * 8192)
        assert_openai_error(await conn.response(), 431)
        assert await conn.closed(within=IO_S)
        await conn.close()


# -- streaming and flow control ----------------------------------------------------------------

# an empty piece writes nothing; the last looks like framing
PIECES = [b"alpha", b"b" * 1000, b"", b"gamma\r\n0\r\n\r\n"]


async def stream(request: Request, exchange: Exchange) -> None:
    exchange.start_stream(200, [(b"content-type", b"text/plain")])
    for piece in PIECES:
        exchange.send(piece)
        await exchange.drain()
    exchange.end_stream(b"tail")


async def test_stream_is_chunked() -> None:
    async with serve({"/stream": stream, "/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/stream"))
        response = await conn.response()
        assert response.status == 200
        assert response.headers[b"transfer-encoding"] == b"chunked"
        assert response.chunks == [p for p in PIECES if p] + [b"tail"]
        conn.send(get("/ping"))   # the terminating chunk was exact: the next response parses
        assert (await conn.response()).body == b"pong"
        await conn.close()


async def test_head_gets_headers_and_no_body() -> None:
    async def sized(request: Request, exchange: Exchange) -> None:
        exchange.respond(200, [], b"0123456789", b"text/plain")

    async with serve({"/stream": stream, "/sized": sized, "/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/stream", method=b"HEAD") + get("/sized", method=b"HEAD") + get("/ping"))
        streamed = await conn.response(head_only=True)
        assert (streamed.status, streamed.headers[b"transfer-encoding"]) == (200, b"chunked")
        whole = await conn.response(head_only=True)
        assert (whole.status, whole.headers[b"content-length"]) == (200, b"10")
        # right after the two heads comes the next response: no body bytes were sent for either
        assert (await conn.response()).body == b"pong"
        await conn.close()


async def test_http_1_0_stream_is_unchunked_and_ends_with_the_close() -> None:
    async with serve({"/stream": stream}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/stream", b"connection: keep-alive", version=b"HTTP/1.0"))
        response = await conn.response()
        assert response.status == 200
        assert b"transfer-encoding" not in response.headers and b"content-length" not in response.headers
        assert response.headers[b"connection"] == b"close"
        assert response.body == b"".join(PIECES) + b"tail"   # read to the end of the connection
        await conn.close()


@pytest.mark.parametrize("side", ["route", "fallback"])
async def test_streaming_to_a_client_that_does_not_read_is_flow_controlled(side: str) -> None:
    """32 MiB in 64 KiB pieces to a client that reads nothing at first: the writer (a handler awaiting
    exchange.drain(), as a route or as the fallback) stalls early; once the client reads, all of it
    arrives intact."""
    piece_size, pieces = 64 * 1024, 512
    total = piece_size * pieces
    sent = 0
    done = asyncio.Event()

    def piece(i: int) -> bytes:
        return bytes([i % 251]) * piece_size

    async def firehose(request: Request, exchange: Exchange) -> None:
        nonlocal sent
        exchange.start_stream(200, [(b"content-type", b"application/octet-stream")])
        for i in range(pieces):
            exchange.send(piece(i))
            sent += piece_size
            await exchange.drain()
        exchange.end_stream()
        done.set()

    routes: dict[str, Handler] = {"/firehose": firehose} if side == "route" else {}
    async with serve(routes, firehose if side == "fallback" else not_found) as s:
        conn = await Conn.open(s.port, rcvbuf=256 * 1024)
        conn.send(get("/firehose"))
        await asyncio.sleep(0.3)
        stalled_at = sent
        await asyncio.sleep(0.2)
        assert sent == stalled_at, "the writer kept writing to a client that reads nothing"
        assert 0 < stalled_at <= total // 4, f"the writer got {stalled_at} of {total} bytes out"
        assert not done.is_set()

        expected = hashlib.sha256()
        for i in range(pieces):
            expected.update(piece(i))
        got = hashlib.sha256()
        received = 0
        async with asyncio.timeout(IO_S * 2):
            head = await conn.reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
            while size := int((await conn.reader.readuntil(b"\r\n"))[:-2], 16):
                got.update(await conn.reader.readexactly(size))
                received += size
                assert await conn.reader.readexactly(2) == b"\r\n"
            assert await conn.reader.readexactly(2) == b"\r\n"
            await done.wait()
        assert received == total
        assert got.digest() == expected.digest()
        await conn.close()


# -- the fallback ------------------------------------------------------------------------------


class Fallback:
    """The fallback handler: records every request it gets and answers 404."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def __call__(self, request: Request, exchange: Exchange) -> None:
        self.requests.append(request)
        await not_found(request, exchange)


async def test_the_fallback_gets_every_path_without_a_route() -> None:
    fallback = Fallback()
    async with serve({"/ping": ping}, fallback) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/ping") + get("/nowhere?x=1") + post("/ping/", b"body"))
        assert (await conn.response()).body == b"pong"   # a route: never reaches the fallback
        for _ in range(2):
            missing = await conn.response()
            assert (missing.status, missing.body) == (404, b"not found")
        await conn.close()
    nowhere, slash = fallback.requests
    assert (nowhere.method, nowhere.path, nowhere.query, nowhere.http_11) == ("GET", "/nowhere", b"x=1", True)
    assert (b"host", b"test") in nowhere.headers
    assert (slash.method, slash.path, slash.body) == ("POST", "/ping/", b"body")


async def test_paths_are_percent_decoded_and_raw_path_is_kept() -> None:
    """`path` with every percent-escape and UTF-8 decoded (as ASGI servers give it), `raw_path` the bytes
    as sent; routes match the decoded path."""
    fallback = Fallback()
    async with serve({"/ping": ping}, fallback) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/caf%C3%A9/a%20b%2Fc?q=%20") + get("/pi%6Eg") + get("/plain") + get("/bad%ff%"))
        assert (await conn.response()).status == 404
        routed = await conn.response()
        assert (routed.body, routed.headers[b"x-path"]) == (b"pong", b"/ping")
        for _ in range(2):
            assert (await conn.response()).status == 404
        await conn.close()
    encoded, plain, bad = fallback.requests
    assert (encoded.path, encoded.raw_path, encoded.query) == ("/café/a b/c", b"/caf%C3%A9/a%20b%2Fc", b"q=%20")
    assert (plain.path, plain.raw_path) == ("/plain", b"/plain")
    assert (bad.path, bad.raw_path) == ("/bad\ufffd%", b"/bad%ff%")


# -- handler errors ----------------------------------------------------------------------------


async def test_a_handler_that_raises_gets_500_and_the_server_keeps_serving() -> None:
    async def boom(request: Request, exchange: Exchange) -> None:
        raise RuntimeError("a bug")

    async with serve({"/boom": boom, "/ping": ping}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/boom"))
        response = await conn.response()
        assert (response.status, response.headers[b"content-type"]) == (500, b"application/json")
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error"
        assert "a bug" not in response.body.decode()   # no internals to the client
        assert response.headers[b"connection"] == b"close"
        assert await conn.closed()
        await conn.close()

        for _ in range(2):
            conn = await Conn.open(s.port)
            conn.send(get("/ping"))
            assert (await conn.response()).body == b"pong"
            await conn.close()


async def test_nothing_is_served_after_a_500() -> None:
    served: list[str] = []

    async def boom(request: Request, exchange: Exchange) -> None:
        raise RuntimeError("a bug")

    async def record(request: Request, exchange: Exchange) -> None:
        served.append(request.path)
        exchange.respond(200, [], b"ok", b"text/plain")

    async with serve({"/boom": boom, "/after": record}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/boom") + get("/after"))
        response = await conn.response()
        assert (response.status, response.headers[b"connection"]) == (500, b"close")
        assert await conn.closed()
        assert served == []
        await conn.close()


# -- stop and drain ----------------------------------------------------------------------------


async def test_stop_lets_requests_in_flight_finish_and_closes_the_rest() -> None:
    started = asyncio.Event()

    async def slow(request: Request, exchange: Exchange) -> None:
        started.set()
        await asyncio.sleep(0.3)
        exchange.respond(200, [], b"finished", b"text/plain")

    async with serve({"/slow": slow, "/ping": ping}) as s:
        idle = await Conn.open(s.port)
        idle.send(get("/ping"))
        assert (await idle.response()).status == 200
        busy = await Conn.open(s.port)
        busy.send(get("/slow"))
        async with asyncio.timeout(IO_S):
            await started.wait()

        t0 = time.monotonic()
        stopping = asyncio.create_task(s.server.stop(10.0))
        async with asyncio.timeout(IO_S):
            while not s.server.draining:  # noqa: ASYNC110 (the server has no event for it)
                await asyncio.sleep(0)
        await asyncio.sleep(0)

        with pytest.raises(ConnectionRefusedError):
            await Conn.open(s.port)
        assert await idle.closed(within=1.0)

        response = await busy.response()
        assert (response.status, response.body) == (200, b"finished")
        assert response.headers[b"connection"] == b"close"
        assert await busy.closed()
        async with asyncio.timeout(IO_S):
            await stopping
        assert time.monotonic() - t0 < 4.0   # done when the last request was, not at the 10 s deadline
        assert not s.server.connections
        await idle.close()
        await busy.close()


@pytest.mark.parametrize("answers", [False, True])
async def test_stop_cuts_a_handler_still_running_at_the_deadline(answers: bool) -> None:
    """At the deadline the handler is cancelled as cut (the client is not gone): one that answers then is
    heard (a 503) before the connection closes; one that does not, the connection is dropped."""
    stuck = Hang(answer_cut=answers)
    async with serve({"/stuck": stuck}) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/stuck"))
        async with asyncio.timeout(IO_S):
            await stuck.started.wait()
        t0 = time.monotonic()
        async with asyncio.timeout(IO_S):
            await s.server.stop(0.3, cut_s=0.3)
            await stuck.cancelled.wait()
        assert 0.25 <= time.monotonic() - t0 < 4.0
        assert (stuck.gone_when_cancelled, stuck.cut_when_cancelled) == ([False], [True])
        if answers:
            answer = await conn.response()
            assert (answer.status, answer.body) == (503, b"shutting down")
        assert await conn.closed()
        await conn.close()


# -- TLS ---------------------------------------------------------------------------------------


async def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def pieces(request: Request, exchange: Exchange) -> None:
        exchange.start_stream(200, [(b"content-type", b"text/plain")])
        for part in (b"one", b"two", b"three"):
            exchange.send(part)
            await exchange.drain()
        exchange.end_stream()

    async with serve({"/echo": echo, "/pieces": pieces}, ssl_context=server_ctx) as s, \
            httpx.AsyncClient(verify=client_ctx, timeout=IO_S) as client:
        base = f"https://127.0.0.1:{s.port}"
        r = await client.post(f"{base}/echo", content=b"over tls")
        assert (r.status_code, r.content) == (200, b"over tls")
        r = await client.get(f"{base}/pieces")
        assert (r.status_code, r.content, r.headers["transfer-encoding"]) == (200, b"onetwothree", "chunked")
        assert len(s.server.connections) == 1   # one TLS connection for both

        with pytest.raises(httpx.ConnectError):   # a client that does not trust the certificate
            async with httpx.AsyncClient(timeout=IO_S) as untrusting:
                await untrusting.get(f"{base}/echo")
