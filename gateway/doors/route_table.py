"""The route table of the front door's own HTTP server: method and path to a handler, for every route but
the two completion routes (which are the server's handlers themselves, `gateway.doors.completions`).

Why a table of its own and not a framework: the gateway serves HTTP on one stack, its own server
(`gateway.doors.http_server`, chosen by measurement: docs/FRONT_DOOR.md), and these routes need little
of a framework: a method, a path with at most one parameter, a key check and a JSON body.

What every route of the table gets:

- a handler `(request, param) -> Reply`, `param` the path parameter ("" on a route without one);
- paths matched as decoded (`Request.path`: percent-escapes, then UTF-8); a parameter is `{name}`, one
  segment, or `{name:path}`, the rest of the path, slashes included (a model id such as `org/model`);
- HEAD wherever GET is: the GET's status and headers, no body (the server leaves the body out);
- 404 for a path no route has; 405 with `allow` for a method the path does not take; a path that
  would match with its trailing slash added or removed: 307 there;
- `x-request-id` on every response (the client's when it is a sane token, else a fresh one), and every
  `RequestError` a handler raises answered in the OpenAI error shape (`gateway.doors.client_errors`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import orjson

from gateway.doors.client_errors import error_headers, error_json
from gateway.doors.http_server import Exchange, Handler, Headers, Request, find_header
from gateway.doors.request_ids import new_request_id
from gateway.requests.errors import RequestError, http_error


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response: what a route's handler returns."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: Headers = field(default_factory=list)


def json_reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(body))


RouteHandler = Callable[[Request, str], Awaitable[Reply]]
Methods = dict[str, RouteHandler]


@dataclass(frozen=True, slots=True)
class _Pattern:
    """A path with one parameter: `prefix`, the parameter, `suffix`."""

    prefix: str
    suffix: str
    rest: bool   # {name:path}: may hold slashes, but neither be empty nor end with one
    methods: Methods

    def match(self, path: str) -> str | None:
        """The parameter's value in `path`, None when `path` is not this pattern's. An empty value or one
        with a final slash is none (`/v1/models/`, `/v1/models/m/`): those paths are the 307 of a slashed
        twin (`fallback`), where they were a 404 blaming `model` '' or 'm/'."""
        if len(path) < len(self.prefix) + len(self.suffix) or not path.startswith(self.prefix) \
                or not path.endswith(self.suffix):
            return None
        value = path[len(self.prefix):len(path) - len(self.suffix)]
        if self.rest:
            return value if value and not value.endswith("/") else None
        return value if value and "/" not in value else None


class RouteTable:
    """Routes by method and path; `handlers()` and `fallback` plug into `HttpServer`."""

    def __init__(self) -> None:
        self._paths: dict[str, Methods] = {}
        self._patterns: list[_Pattern] = []
        self._elsewhere: set[str] = set()   # paths the server answers itself: known here for their 307s only

    def served_elsewhere(self, paths: Iterable[str]) -> None:
        """Paths the server has handlers of its own for (the completions door's): a request to one with its
        trailing slash added or removed is redirected there, as to the table's own."""
        self._elsewhere.update(paths)

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        """`handler` answers `method` on `path`; a GET route answers HEAD too."""
        methods = self._methods(path)
        for name in (method, "HEAD") if method == "GET" else (method,):
            if name in methods:
                raise ValueError(f"{name} {path} has a route already")
            methods[name] = handler

    def _methods(self, path: str) -> Methods:
        start, end = path.find("{"), path.find("}")
        if start < 0:
            return self._paths.setdefault(path, {})
        if end < start or "{" in path[end:] or "}" in path[end + 1:]:
            raise ValueError(f"a route's path holds at most one {{parameter}}: {path}")
        prefix, name, suffix = path[:start], path[start + 1:end], path[end + 1:]
        rest = name.endswith(":path")
        for pattern in self._patterns:
            if (pattern.prefix, pattern.suffix, pattern.rest) == (prefix, suffix, rest):
                return pattern.methods
        self._patterns.append(_Pattern(prefix, suffix, rest, {}))
        return self._patterns[-1].methods

    def handlers(self) -> dict[str, Handler]:
        """The server's handlers of the table's paths without a parameter."""
        return {path: functools.partial(self._serve, methods=methods, param="")
                for path, methods in self._paths.items()}

    def _lookup(self, path: str) -> tuple[Methods, str] | None:
        methods = self._paths.get(path)
        if methods is not None:
            return methods, ""
        for pattern in self._patterns:
            param = pattern.match(path)
            if param is not None:
                return pattern.methods, param
        return None

    async def fallback(self, request: Request, exchange: Exchange) -> None:
        """The server's handler for every path it has no handler of its own for."""
        path = request.path
        found = self._lookup(path)
        if found is not None:
            await self._serve(request, exchange, methods=found[0], param=found[1])
            return
        other = path[:-1] if path.endswith("/") else path + "/"
        if path != "/" and (other in self._elsewhere or self._lookup(other) is not None):
            location = quote(other).encode() + (b"?" + request.query if request.query else b"")
            exchange.respond(307, [(b"location", location), (b"x-request-id", request_id(request).encode())], b"")
            return
        _error(request, exchange, http_error(404, "Not Found"), [])

    async def _serve(self, request: Request, exchange: Exchange, *, methods: Methods, param: str) -> None:
        handler = methods.get(request.method)
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            _error(request, exchange, http_error(405, "Method Not Allowed"), [(b"allow", allow)])
            return
        try:
            reply = await handler(request, param)
        except RequestError as exc:
            _error(request, exchange, exc, [])
            return
        exchange.respond(reply.status, [*reply.headers, (b"x-request-id", request_id(request).encode())],
                         reply.body, reply.content_type)


def request_id(request: Request) -> str:
    """The client's `x-request-id` when it is a sane token, else a fresh one."""
    given = find_header(request.headers, b"x-request-id")
    return new_request_id(given.decode("latin-1") if given is not None else None)


def _error(request: Request, exchange: Exchange, err: RequestError, headers: Headers) -> None:
    exchange.respond(err.status, [*error_headers(err, request_id(request)), *headers], error_json(err))
