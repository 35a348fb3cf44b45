"""The front door's HTTP/1.1 server: an asyncio protocol over httptools (the C parser uvicorn uses).

Why not uvicorn: in front of a fast engine, uvicorn's ASGI cycle (scope and message dicts, header
checks, two writes a response) and the task a raw-ASGI route needs to hear a disconnect were about a
quarter of the gateway's CPU per request (docs/FRONT_DOOR.md). Here the hot routes (the completions
door) get the parsed request and write their response to the transport themselves, in one write; a
client that leaves cancels its handler from `connection_lost`, with no watcher task. It is the
gateway's only HTTP server: every other route (models, health, metrics, admin, the dashboard) is a
handler of it too, through the route table (`gateway.doors.route_table`).

What it does: keep-alive with an idle timeout (which also bounds how long a request's line and
headers may take to arrive), a deadline for the whole body from the end of the headers (408 and a
close: a body that stalls, short or trickled, would otherwise hold its connection and its buffered
bytes forever), pipelined requests answered in order, `Expect: 100-continue`, bodies capped before
they are buffered (413), header blocks capped (431), malformed requests answered 400 and logged,
chunked streaming with write flow control, TLS through the loop, and a drain on stop (no new
requests; those in flight finish, up to a deadline). With `gateway.cors` on, CORS for browsers on
other origins (`Cors`); off, it costs a request one `is None` check.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import http
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import unquote_to_bytes

import httptools
import orjson
import structlog

from gateway.doors.request_ids import new_request_id
from gateway.requests.errors import Forbidden, http_error, openai_error_body

log = structlog.get_logger("gateway.http")

Headers = list[tuple[bytes, bytes]]

MAX_HEADER_BYTES = 64 * 1024     # request line and headers; more gets 431
MAX_PIPELINED = 16               # complete requests queued behind the one in flight before reading pauses
RETURN_BYTES = 1 << 20           # a dropped body at least this large has its memory handed back to the OS
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_JSON = b"application/json"


class Request:
    """One parsed request; header names are lower case. `path` is decoded (every percent-escape, `%2F`
    included, then UTF-8, as ASGI servers give it), and routes match it; `raw_path` is the bytes as sent."""

    __slots__ = ("body", "headers", "http_11", "method", "path", "query", "raw_path")

    def __init__(self, method: str, raw_path: bytes, query: bytes, headers: Headers, body: bytes,
                 http_11: bool) -> None:
        self.method, self.raw_path, self.query, self.headers, self.body, self.http_11 = \
            method, raw_path, query, headers, body, http_11
        self.path = decode_path(raw_path)


def origin_form(target: bytes) -> bytes:
    """The path of an absolute-form target (`http://host:port/v1/models`, RFC 9112 §3.2.2: a server
    must take it, and some proxies send it), "/" when it has none; any other target as it is."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    slash = rest.find(b"/")
    return rest[slash:] if slash >= 0 else b"/"


def decode_path(raw: bytes) -> str:
    if b"%" not in raw and raw.isascii():
        return raw.decode("ascii")
    return unquote_to_bytes(raw).decode("utf-8", "replace")


Handler = Callable[[Request, "Exchange"], Awaitable[None]]


def find_header(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case)."""
    for key, value in headers:
        if key == name:
            return value
    return None


class _Date:
    """The `date` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode() + b"\r\n"
        return self._line


_DATE = _Date()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, None elsewhere. Why: the pieces of a large body come from malloc's heap, and
    freed they stay in the process (20 stalled 32 MiB bodies left 380 MB resident after their connections
    closed); a trim returns them."""
    with contextlib.suppress(OSError, AttributeError):
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
        return trim
    return None


_TRIM = _malloc_trim()


def _head(status: int, headers: Headers, framing: bytes, keep_alive: bool) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"")), _DATE.line()]
    parts.extend(b"%s: %s\r\n" % kv for kv in headers)
    parts.append(framing)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class Exchange:
    """The response side of one request, written straight to its connection.

    `respond` writes a whole response in one write; `start_stream` / `send` / `end_stream` write one in
    pieces, chunked (`drain` waits while the client reads slower than the gateway writes). The head of
    a streamed response goes out with its first piece: one write fewer, and the first piece follows
    the head at once anyway. `gone` turns true when the client disconnected before the response was
    complete: the handler is cancelled then. `cut` turns true when the gateway stops and its drain time
    ran out with the response incomplete: the handler is cancelled, and ends the response itself (a 503,
    or an error event on a stream) before the connection is dropped.
    """

    __slots__ = ("_chunked", "_conn", "_head", "_head_only", "_http_11", "cut", "done", "gone", "started")

    def __init__(self, conn: _Connection, head_only: bool, http_11: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._http_11 = http_11
        self._chunked = False
        self._head = b""
        self.started = self.done = self.gone = self.cut = False

    def respond(self, status: int, headers: Headers, body: bytes, content_type: bytes = _JSON) -> None:
        self.started = self.done = True
        conn = self._conn
        head = _head(status, [(b"content-type", content_type), *headers],
                     b"content-length: %d\r\n" % len(body), conn.keep_alive)
        conn.write(head if self._head_only else head + body)

    def start_stream(self, status: int, headers: Headers, *, sized: bool = False) -> None:
        """Chunked unless `sized` (the headers carry content-length) or the client speaks HTTP/1.0 (then
        the body runs to the end of the connection)."""
        self.started = True
        conn = self._conn
        self._chunked = self._http_11 and not sized
        if not self._http_11 and not sized:
            conn.keep_alive = False
        self._head = _head(status, headers, b"transfer-encoding: chunked\r\n" if self._chunked else b"",
                           conn.keep_alive)

    def send(self, data: bytes) -> None:
        if self._head_only or not data:
            return
        piece = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._head:
            piece, self._head = self._head + piece, b""
        self._conn.write(piece)

    async def drain(self) -> None:
        await self._conn.drain()

    def end_stream(self, tail: bytes = b"") -> None:
        self.done = True
        last = b"%x\r\n%b\r\n" % (len(tail), tail) if self._chunked and tail else tail
        if self._chunked:
            last += b"0\r\n\r\n"
        self._conn.write(self._head + (b"" if self._head_only else last))
        self._head = b""


class _CorsExchange(Exchange):
    """An exchange whose response, whole or streamed, carries the CORS headers of its request's origin."""

    __slots__ = ("_cors",)

    def __init__(self, conn: _Connection, head_only: bool, http_11: bool, cors: Headers) -> None:
        super().__init__(conn, head_only, http_11)
        self._cors = cors

    def respond(self, status: int, headers: Headers, body: bytes, content_type: bytes = _JSON) -> None:
        super().respond(status, [*headers, *self._cors], body, content_type)

    def start_stream(self, status: int, headers: Headers, *, sized: bool = False) -> None:
        super().start_stream(status, [*headers, *self._cors], sized=sized)


class Cors:
    """CORS (the Fetch standard's protocol) for browsers calling the gateway from other origins.

    A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`), on any path, is answered
    here before any route sees it, so before any key check: a browser sends no credentials with it.

    From an allowed origin: 204 with `access-control-allow-origin`, `-allow-methods`, `-allow-headers`,
    `-max-age` (and `-allow-credentials`). The method and headers it asked for are not checked against
    the lists: the browser does that with the lists it gets (as the Fetch standard has it), and its
    console names what was missing. Only `"*"` and prefixes (`x-stainless-*`) make the answer depend
    on what it asked for: the headers asked for that they allow are listed by name.

    From another origin: 403 in the OpenAI error shape, naming the origin. A browser fails the
    preflight either way (no allow-origin header, whatever the status); a 403 that says why, rather than
    a 204 without the headers (what Express's `cors` sends), tells whoever reads it with curl or in the
    network tab what to configure. Starlette's CORS middleware (vLLM's, LiteLLM's) refuses too, with a
    400 in plain text; 403 is the status for "understood, not allowed", and the body is the gateway's
    usual error shape.

    Every other request with an allowed `Origin` gets, on whatever the response is (a route's reply, an
    error, a stream, a refused request), `access-control-allow-origin` (the origin, with `vary:
    origin`, or `*` when every origin is allowed), `access-control-expose-headers`, and with
    credentials `access-control-allow-credentials: true`. A request with no `Origin` or another one
    gets none: the browser then keeps the response from the page. The headers are built once per
    allowed origin: a request costs a scan for `Origin` and one dict lookup.
    """

    def __init__(self, allow_origins: list[str], *, allow_methods: list[str], allow_headers: list[str],
                 expose_headers: list[str], max_age_s: int, allow_credentials: bool) -> None:
        if not allow_origins:
            raise ValueError("CORS needs at least one allowed origin")
        expose = [(b"access-control-expose-headers", ", ".join(expose_headers).encode())] if expose_headers else []
        creds = [(b"access-control-allow-credentials", b"true")] if allow_credentials else []
        self._any: Headers | None = None
        if "*" in allow_origins:   # config refuses credentials with "*"
            self._any = [(b"access-control-allow-origin", b"*"), *expose, *creds]
        self._by_origin: dict[bytes, Headers] = {
            origin.encode(): [(b"access-control-allow-origin", origin.encode()), (b"vary", b"origin"), *expose, *creds]
            for origin in allow_origins if origin != "*"}
        self._methods = None if "*" in allow_methods else ", ".join(allow_methods).encode()
        self._any_header = "*" in allow_headers
        self._headers = ", ".join(h for h in allow_headers if not h.endswith("*")).encode()
        self._prefixes = tuple(h[:-1].encode() for h in allow_headers if h.endswith("*") and h != "*")
        self._preflight_tail = [(b"access-control-max-age", b"%d" % max_age_s), *creds]

    def headers(self, request_headers: Headers) -> Headers | None:
        """The CORS headers of a response to a request with these headers; None: none (no Origin, or one
        not allowed)."""
        origin = find_header(request_headers, b"origin")
        if origin is None:
            return None
        return self._by_origin.get(origin, self._any)

    @staticmethod
    def is_preflight(request: Request) -> bool:
        return request.method == "OPTIONS" and find_header(request.headers, b"origin") is not None \
            and find_header(request.headers, b"access-control-request-method") is not None

    async def preflight(self, request: Request, exchange: Exchange) -> None:
        """A server handler: the answer to a preflight (see the class)."""
        origin = find_header(request.headers, b"origin") or b""
        vary: list[bytes] = []   # what the answer depends on, for caches
        if origin in self._by_origin:
            allow_origin = origin
            vary.append(b"origin")
        elif self._any is not None:
            allow_origin = b"*"
        else:
            refused = Forbidden(f"CORS: origin {origin.decode('latin-1')} is not allowed (gateway.cors.allow_origins)",
                                code="origin_not_allowed")
            given = find_header(request.headers, b"x-request-id")
            rid = new_request_id(given.decode("latin-1") if given is not None else None).encode()
            exchange.respond(403, [(b"x-request-id", rid)], orjson.dumps(openai_error_body(refused)))
            return
        methods = self._methods
        if methods is None:   # "*": the method it asked for
            methods = find_header(request.headers, b"access-control-request-method") or b""
            vary.append(b"access-control-request-method")
        headers = self._headers
        if self._any_header or self._prefixes:   # the answer depends on the headers it asked for
            asked = find_header(request.headers, b"access-control-request-headers") or b""
            if self._any_header:
                headers = asked
            else:   # the list, and those asked for that a prefix allows (a preflight lists names, not patterns)
                names = [n for n in (h.strip().lower() for h in asked.split(b",")) if n.startswith(self._prefixes)]
                headers = b", ".join(([headers] if headers else []) + names)
            vary.append(b"access-control-request-headers")
        allowed: Headers = [(b"access-control-allow-origin", allow_origin)]
        if vary:
            allowed.append((b"vary", b", ".join(vary)))
        allowed.extend(((b"access-control-allow-methods", methods), (b"access-control-allow-headers", headers),
                        *self._preflight_tail))
        exchange.start_stream(204, allowed, sized=True)   # no content-type, no content-length on a 204
        exchange.end_stream()


class _Reject(Exception):
    """A request refused while it is read (too large, bad framing): answered, then the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps(openai_error_body(http_error(status, message)))


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: Headers = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._pending: collections.deque[tuple[Request, bool]] = collections.deque()   # (request, keep-alive)
        self._task: asyncio.Task[None] | None = None
        self._exchange: Exchange | None = None
        self.keep_alive = True
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._due: float | None = None   # loop time the idle wait or the body's read ends; None: neither runs
        self._in_body = False            # a request's body is being read: `_due` is its deadline
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._closed = False
        self._last_read = False     # a request without keep-alive, or a refused one, was read: no more are
        self._queue_full = False    # reading paused while MAX_PIPELINED requests wait
        self._owe_continue = False  # a 100 Continue to send once the responses before it are written
        self._refusal = b""         # the answer to a request that could not be read, after those before it
        self._in_head = False       # a request's line and headers are being read
        self._authorized = False    # the request being read has an Authorization header
        self._head_seen = 0         # bytes received since its first byte

    # -- transport events ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport   # type: ignore[assignment]  # asyncio and uvloop set TCP_NODELAY
        self._server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._last_read:
            return    # discarded, but still read: with reading paused, a client that leaves would go unheard
        if self._in_head:   # httptools holds a header line until it ends: an endless one is capped here
            self._head_seen += len(data)
            if self._head_seen > 2 * MAX_HEADER_BYTES:
                self._refuse(431, f"request headers over {MAX_HEADER_BYTES} bytes")
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass      # upgrades (h2c, websocket) are not offered: the request is served as plain HTTP/1.1
        except httptools.HttpParserCallbackError as exc:
            reject = exc.__context__
            if not isinstance(reject, _Reject):
                raise
            self._refuse(reject.status, str(reject))
        except httptools.HttpParserError as exc:
            if self._last_read:
                return    # bytes after a request that closes the connection: never read, not an error
            log.warning("invalid_http_request", error=str(exc))
            self._refuse(400, "invalid HTTP request")
            return
        if self._in_body and self._due is None and not self._owe_continue:
            self._arm_body()   # the body did not come whole with its head: its deadline runs from now

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # The parser refers back to this object: the cycle waits for a full collection, which the
        # daemon's GC thresholds make rare. A half-read body (up to max_body_bytes) must not wait with it.
        self._drop_body()
        self._pending.clear()
        exchange = self._exchange
        if exchange is not None and not exchange.done and self._task is not None:
            exchange.gone = True
            self._task.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._authorized = False
        self._head_seen = 0
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Reject(414, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Reject(431, f"request headers over {MAX_HEADER_BYTES} bytes")
        name = name.lower()
        if name == b"authorization":   # two: each reader of headers might take a different one
            if self._authorized:
                raise _Reject(400, "two Authorization headers: send one")
            self._authorized = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._due = None       # the idle timer also bounds how long a request's head may take: until now
        self._in_body = True   # until on_message_complete, which comes at once for a body already here
        limit = self._server.max_body_bytes
        declared = find_header(self._headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Reject(413, f"request body is {int(declared)} bytes; the limit is {limit}")
        expect = find_header(self._headers, b"expect")
        if expect is not None and expect.lower() == b"100-continue" and self._transport is not None:
            if self._task is None and not self._pending:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:   # a 1xx answers the request being read: not before (or inside) the responses ahead of it
                self._owe_continue = True

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._server.max_body_bytes:
            raise _Reject(413, f"request body is over the limit of {self._server.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        path, _, query = self._url.partition(b"?")
        if not path.startswith(b"/"):
            path = origin_form(path)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body, self._body_size = [], 0   # the pieces go now, not with the next request
        request = Request(parser.get_method().decode("ascii", "replace"), path, query, self._headers, body,
                          parser.get_http_version() == "1.1")
        keep = parser.should_keep_alive()
        self._pending.append((request, keep))
        self._owe_continue = False       # the body came without it
        self._in_body = False
        self._due = None
        transport = self._transport
        if not keep:
            self._last_read = True       # nothing after this request is served on this connection
        if self._task is None:
            self._next()
        elif len(self._pending) > MAX_PIPELINED and transport is not None:
            self._queue_full = True
            transport.pause_reading()

    # -- requests --------------------------------------------------------------------------

    def _next(self) -> None:
        """Starts the next queued request, or waits idle for one. After a response that said `connection:
        close` nothing more is served, queued or not (RFC 9112 §9.6)."""
        if not self.keep_alive:
            self.close()
            return
        if not self._pending:
            if self._refusal:
                self.write(self._refusal)
                self.close()
                return
            if self._owe_continue and self._transport is not None:
                self._owe_continue = False
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._arm_body()   # the client was waiting for it: the body's time starts now
            self._arm_idle()
            return
        request, keep = self._pending.popleft()
        if self._queue_full and self._transport is not None:
            self._queue_full = False     # room in the queue again: read what the client sent meanwhile
            self._transport.resume_reading()
        if not keep or self._server.draining:
            self.keep_alive = False
        cors = self._server.cors
        if cors is None:
            exchange = Exchange(self, request.method == "HEAD", request.http_11)
            handler = self._server.routes.get(request.path, self._server.fallback)
        else:
            exchange, handler = self._cors_exchange(cors, request)
        self._exchange = exchange
        self._task = self._loop.create_task(self._run(handler(request, exchange), exchange))

    def _cors_exchange(self, cors: Cors, request: Request) -> tuple[Exchange, Handler]:
        """With CORS on: a preflight goes to `cors.preflight`, before any route (and its key check) sees
        it; a request from an allowed origin gets an exchange that adds the origin's headers."""
        if cors.is_preflight(request):
            return Exchange(self, False, request.http_11), cors.preflight
        allowed = cors.headers(request.headers)
        exchange = Exchange(self, request.method == "HEAD", request.http_11) if allowed is None \
            else _CorsExchange(self, request.method == "HEAD", request.http_11, allowed)
        return exchange, self._server.routes.get(request.path, self._server.fallback)

    async def _run(self, coro: Awaitable[None], exchange: Exchange) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            if not exchange.gone:
                raise
        except Exception:   # a handler's bug: the client gets a 500, the connection goes
            log.exception("http_handler_failed")
            self.keep_alive = False
            if not exchange.started:
                exchange.respond(500, [], error_body(500, "internal error"))
        finally:
            if not exchange.done:
                self.keep_alive = False
                self.close()
            self._task = None
            self._exchange = None
            if not self._closed:
                self._next()

    def write(self, data: bytes) -> None:
        if not self._closed and self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        if self._paused and not self._closed:
            self._drained = self._loop.create_future()
            await self._drained

    def _refuse(self, status: int, message: str) -> None:
        """Answers a request that could not be read and closes: at once when nothing is in flight, else
        after the responses to the requests read before it (they were well formed; they are served)."""
        given = find_header(self._headers, b"x-request-id")
        rid = new_request_id(given.decode("latin-1") if given is not None else None).encode()
        body = error_body(status, message)
        if self._server.on_refused is not None:
            self._server.on_refused(self._url.partition(b"?")[0], status, rid.decode(), message)
        headers = [(b"content-type", _JSON), (b"x-request-id", rid)]
        if self._server.cors is not None:   # the headers read so far: enough for `Origin`, unless it came late
            headers.extend(self._server.cors.headers(self._headers) or ())
        self._refusal = _head(status, headers, b"content-length: %d\r\n" % len(body), False) + body
        self._last_read = True
        self._owe_continue = False
        self._in_body = False
        self._due = None
        self._drop_body()   # what came of a refused body is not kept while the responses ahead are written
        if self._task is None:
            self._next()

    def _drop_body(self) -> None:
        if self._body_size >= RETURN_BYTES:
            self._server.return_memory()
        self._body, self._body_size = [], 0

    def _arm_idle(self) -> None:
        """The connection is idle from now: it closes `idle_s` on unless a request's head completes first
        (a body being read keeps its own deadline)."""
        if not self._in_body:
            self._arm(self._loop.time() + self._server.idle_s)

    def _arm_body(self) -> None:
        """The request's body must be whole `body_timeout_s` from now, else 408 and a close."""
        self._arm(self._loop.time() + self._server.body_timeout_s)

    def _arm(self, due: float) -> None:
        """One timer lives across requests and both waits (checked when it fires, armed again only if
        needed), not one armed and cancelled per request: moved only when `due` is sooner."""
        self._due = due
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(due, self._expired)

    def _expired(self) -> None:
        self._timer = None
        due = self._due
        if due is None:   # busy: the timer is armed again when the connection waits again
            return
        if self._loop.time() < due:   # waiting again since the timer was armed
            self._timer_at = due
            self._timer = self._loop.call_at(due, self._expired)
        elif self._in_body:
            log.info("request_body_timeout", received=self._body_size, limit_s=self._server.body_timeout_s)
            self._refuse(408, f"the request's body did not arrive within {self._server.body_timeout_s:g} s")
        else:
            self.close()

    def close(self) -> None:
        if not self._closed and self._transport is not None:
            self._closed = True
            self._transport.close()

    def idle(self) -> bool:
        return self._task is None and not self._pending

    def cut(self) -> None:
        """The gateway stops: the request under way is cancelled, its handler told why (`Exchange.cut`)."""
        exchange = self._exchange
        self.keep_alive = False
        if exchange is not None and not exchange.done and self._task is not None:
            exchange.cut = True
            self._task.cancel()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


# Told of each request refused while it was read (413, 408, 431, 414, 400): its path as sent (up to the
# query; what was read of it), status, request id and message. No handler ever sees such a request.
OnRefused = Callable[[bytes, int, str, str], None]


class HttpServer:
    """Serves `routes` (exact paths) with their handlers, and every other path with `fallback`; with
    `cors`, CORS on every path (`Cors`); `on_refused` hears of the requests refused while read."""

    def __init__(self, routes: dict[str, Handler], fallback: Handler, *, max_body_bytes: int, idle_s: float,
                 body_timeout_s: float, ssl_context: ssl.SSLContext | None = None, cors: Cors | None = None,
                 on_refused: OnRefused | None = None) -> None:
        self.routes = routes
        self.cors = cors
        self.on_refused = on_refused
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self.idle_s = idle_s
        self.body_timeout_s = body_timeout_s
        self.connections: set[_Connection] = set()
        self.draining = False
        self._trim: asyncio.TimerHandle | None = None
        self._ssl = ssl_context
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock, ssl=self._ssl,
                                                backlog=2048)

    def return_memory(self) -> None:
        """Hands freed heap memory back to the OS, a second from now: one trim for the bodies dropped
        meanwhile (it walks the heap: not once per connection an attacker closes)."""
        if _TRIM is not None and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(1.0, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        if _TRIM is not None:
            _TRIM(0)

    async def stop(self, drain_s: float, cut_s: float = 1.0) -> None:
        """Stops accepting, lets requests in flight finish for up to `drain_s`, then cuts those still
        under way (`_Connection.cut`: each handler ends its response) and, `cut_s` later, drops every
        connection left."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        await self._close_idle(time.monotonic() + drain_s)
        if self.connections:
            for conn in list(self.connections):
                conn.cut()
            await self._close_idle(time.monotonic() + cut_s)
        for conn in list(self.connections):
            conn.abort()
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        if self._server is not None:
            await self._server.wait_closed()

    async def _close_idle(self, deadline: float) -> None:
        """Close each connection once it is idle, until none is left or the deadline."""
        while True:
            for conn in list(self.connections):
                if conn.idle():
                    conn.close()
                else:
                    conn.keep_alive = False
            if not self.connections or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)
