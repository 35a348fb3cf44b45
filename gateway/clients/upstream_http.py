"""A lean keep-alive HTTP/1.1 client for the completions of `kind: openai` upstreams.

One pool of connections per upstream (host, port, TLS); each request is one write (head and body),
its response parsed by httptools (the C parser uvicorn uses) straight from the socket's reads, and
its body read to the end, so that the connection goes back to the pool. A response the caller
leaves unread closes its connection instead: a connection is never reused mid-response. A connection
idle for `idle_s` is closed by the pool's timer, whether or not another request comes.

Why not aiohttp's general client here: in front of a fast engine (loopback, 64 concurrent
requests), aiohttp's request path (session, connector, request and response objects, payload
writer, cookie and header handling) cost 87 µs of CPU per request, the largest single part of the
gateway's; this client costs 18 µs (`benchmarks/upstream_client.py`, one run, medians of 3 rounds).
httpx serves everything else (scrapes, probes, image fetches), where per-request CPU matters less.

Errors are OSErrors (`UpstreamClosed`, `UpstreamProtocolError`, connect errors) or TimeoutErrors;
the caller bounds every wait. A reused connection that the upstream closed while it sat idle (its
keep-alive ran out first) fails before any byte of the response arrives: that request is sent once
more on a new connection, as HTTP clients do with a stale keep-alive connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024   # unread body bytes before the socket stops being read
_INF = float("inf")
_SWEEP_S = 0.01   # the least time between two passes of a pool's deadline timer


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the response ended."""


class UpstreamProtocolError(ConnectionError):
    """The upstream's bytes are not an HTTP/1.1 response."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one response at a time, its body buffered until read."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: OSError | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False       # it served a response before the current one
        self.started = False      # a byte of the current response arrived
        self.head_done = False    # its status line and headers are parsed
        self.complete = False     # all of it is parsed
        self.keep_alive = False
        self._until_eof = False   # the body has neither a length nor chunks: it ends with the connection
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)   # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and self._until_eof and exc is None:   # a body delimited by the connection's end
            self.complete = True
            self._wake()
        if not self.complete:
            self._fail(UpstreamClosed("the upstream closed the connection before the response ended"))

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self._until_eof = not self.keep_alive and not any(
            name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- one exchange ----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self._transport is not None
        self.reused = self.status != 0
        self.started = self.head_done = self.complete = self.keep_alive = False
        self.status, self.headers = 0, []
        self._body, self._buffered, self._error = [], 0, None
        self._transport.write(data)

    def time_out(self) -> None:
        """The exchange's deadline passed: its wait, now or next, ends with TimeoutError."""
        self._fail(TimeoutError())

    async def head(self) -> int:
        """Wait for the status line and headers; the status code."""
        while not self.head_done:
            await self._wait()
        return self.status

    async def read_some(self, until: float | None = None) -> bytes:
        """The body bytes that arrived since the last read, waiting for some (TimeoutError at loop time
        `until`); b"" at the end."""
        while not self._body:
            if self.complete:
                return b""
            await self._wait(until)
        return self.take()

    def take(self) -> bytes:
        """The body bytes that arrived since the last read (b"": none)."""
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body, self._buffered = [], 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, until: float | None = None) -> None:
        """Until the parser has news. The bound is a timer on this wait only, set only when there is
        something to wait for: a read whose bytes are already here costs no timer (asyncio.timeout
        per read was a tenth of a streamed request's CPU)."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        timer = None if until is None else self._loop.call_at(until, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: OSError) -> None:
        if self._error is None:
            self._error = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)


class _Deadlines:
    """The deadlines of a pool's bounded exchanges, with one loop timer for all of them.

    A uvloop timer armed and cancelled per request cost ~3 µs of it; here a bounded exchange is one
    dict entry while it runs, and the one timer is armed at the earliest deadline. When it fires, the
    exchanges past theirs time out and it is armed at the next deadline, not sooner than `_SWEEP_S`
    from then (a burst of timeouts costs one pass per interval, each deadline kept within it).
    """

    def __init__(self) -> None:
        self._due: dict[_Connection, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _INF

    def add(self, conn: _Connection, until: float) -> None:
        self._due[conn] = until
        if until < self._timer_at:
            self._arm(until)

    def discard(self, conn: _Connection) -> None:
        self._due.pop(conn, None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, _INF
        self._due.clear()

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = asyncio.get_running_loop().call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer, self._timer_at = None, _INF
        now = asyncio.get_running_loop().time()
        nearest = _INF
        for conn, until in list(self._due.items()):
            if until <= now:
                del self._due[conn]
                conn.time_out()
            elif until < nearest:
                nearest = until
        if nearest < _INF:
            self._arm(max(nearest, now + _SWEEP_S))


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UpstreamResponse:
    """A response being read. `release()` (always, e.g. in a finally) hands the connection back to the
    pool when the body was read to its end and the upstream keeps it alive, else closes it."""

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers

    async def read_some(self, until: float | None = None) -> bytes:
        """The body bytes that arrived since the last read, waiting for some (TimeoutError at loop time
        `until`); b"" at the end."""
        if self._conn is None:
            raise UpstreamClosed("the response was released")
        return await self._conn.read_some(until)

    async def read(self, until: float | None = None) -> bytes:
        """The whole body (TimeoutError at loop time `until`)."""
        conn = self._conn
        if conn is not None and conn.complete:   # all of it is here already, as a small reply mostly is
            return conn.take()
        parts = []
        while data := await self.read_some(until):
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._pool.put(conn)


class UpstreamPool:
    """Keep-alive connections to one upstream, at most `max_connections` open (or opening) at once.

    A request beyond the limit waits for a connection to come back (it is handed over directly) or
    for one to close (its slot is handed over, and the waiter connects anew).
    """

    def __init__(self, base_url: str, *, max_connections: int, idle_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if tls else 80)
        self._ssl: ssl.SSLContext | None = (ssl_context or ssl.create_default_context()) if tls else None
        self._prefix = parts.path.rstrip("/")
        default_port = self._port == (443 if tls else 80)
        self._host_header = (self._host if default_port else f"{self._host}:{self._port}").encode()
        self._idle: deque[_Connection] = deque()
        self._idle_s = idle_s
        self._max = max_connections
        self._slots_taken = 0   # connections open or opening
        self._open: set[_Connection] = set()
        # Waiting for a connection (handed over) or a free slot (None).
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._deadlines = _Deadlines()
        self._sweep: asyncio.TimerHandle | None = None   # closes the idle connections past `idle_s`

    async def post(
        self, path: str, body: bytes, headers: Sequence[tuple[str, str]], *, connect_timeout_s: float,
        until: float | None = None,
    ) -> UpstreamResponse:
        """Send a POST and wait for its status and headers. `until`: the exchange ends with TimeoutError
        at that loop time, whichever wait it is in (a free connection, the head, the body read before
        the response is released); the pool's one deadline timer (`_Deadlines`), not an
        `asyncio.timeout` around each wait. Without it the caller bounds the waits."""
        head = [f"POST {self._prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            head.append(f"{name}: {value}\r\n".encode())
        head.append(b"\r\n")
        request = b"".join(head) + body
        while True:
            conn = self._reuse() or await self._acquire(connect_timeout_s, until)
            conn.send(request)
            if until is not None:
                self._deadlines.add(conn, until)
            try:
                await conn.head()
            except UpstreamClosed:
                self.put(conn)
                if conn.reused and not conn.started:   # a stale keep-alive connection: once more, anew
                    continue
                raise
            except BaseException:
                self.put(conn)
                raise
            return UpstreamResponse(self, conn)

    def put(self, conn: _Connection) -> None:
        """A connection back from a response: reused if the response ended and it stays alive."""
        self._deadlines.discard(conn)
        if conn not in self._open:
            return
        if conn.closed or not conn.complete or not conn.keep_alive:
            self._drop(conn)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._idle_s, self._sweep_idle)

    async def close(self) -> None:
        self._deadlines.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()

    async def _acquire(self, connect_timeout_s: float, until: float | None) -> _Connection:
        """A connection when none is idle: a slot's new one, or one handed back, by loop time `until`."""
        if until is None:
            return await self._take_slot(connect_timeout_s)
        async with asyncio.timeout_at(until):
            return await self._take_slot(connect_timeout_s)

    async def _take_slot(self, connect_timeout_s: float) -> _Connection:
        if self._slots_taken >= self._max:
            waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():   # handed over as it was cancelled: pass it on
                    if (passed := waiter.result()) is not None:
                        self.put(passed)
                    else:
                        self._free_slot()
                raise
            if handed is not None:
                return handed
        else:
            self._slots_taken += 1
        return await self._connect(connect_timeout_s)

    def _reuse(self) -> _Connection | None:
        """The most recently pooled live connection (the least likely to have timed out); the expired
        and closed ones at the other end are dropped on the way."""
        idle = self._idle
        self._drop_expired()
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._drop(conn)
        return None

    def _drop_expired(self) -> None:
        """Close the idle connections pooled `idle_s` ago or longer (the oldest are first in line), and
        those the upstream closed."""
        idle = self._idle
        expired = time.monotonic() - self._idle_s
        while idle and (idle[0].closed or idle[0].idle_since <= expired):
            self._drop(idle.popleft())

    def _sweep_idle(self) -> None:
        """The idle connections' timer: without it, those left after a burst stayed open (each a socket
        and an upstream slot) until the next request or the upstream's own keep-alive, which may be far
        longer than `idle_s`. Armed again for the oldest connection still idle."""
        self._sweep = None
        self._drop_expired()
        if self._idle:
            due = self._idle[0].idle_since + self._idle_s - time.monotonic()
            self._sweep = asyncio.get_running_loop().call_later(max(due, _SWEEP_S), self._sweep_idle)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)
        self._free_slot()

    def _free_slot(self) -> None:
        """A slot is free: the first waiter takes it (and connects), else it is counted free."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._slots_taken -= 1

    async def _connect(self, timeout_s: float) -> _Connection:
        """A new connection in a slot already taken (given back if the connect fails)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                )
        except BaseException:
            self._free_slot()
            raise
        self._open.add(conn)
        return conn
