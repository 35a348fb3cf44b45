"""The front door's route table (gateway.doors.route_table) on the real HTTP server on loopback, with raw
sockets against handlers written here: 404 and 405 (with `allow`) in the OpenAI error shape, HEAD with
the GET's status and headers and no body, paths matched percent-decoded, one path parameter, the 307 of
a trailing slash, `x-request-id` on every response, a handler's error, two Authorization headers."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import orjson
import pytest

from gateway.doors.http_server import Request
from gateway.doors.route_table import Reply, RouteTable, json_reply
from gateway.requests.errors import Overloaded, Unauthorized
from tests.integration.test_http_server import Conn, Response, Served, assert_openai_error, get, post, serve

pytestmark = pytest.mark.timeout(30)   # a backstop; every read is bounded (test_http_server.IO_S)


async def things(request: Request, _: str) -> Reply:
    if find(request, b"authorization") != b"Bearer ok":
        raise Unauthorized("invalid API key")
    return Reply(200, b"three things", b"text/plain; charset=utf-8", [(b"x-things", b"3")])


async def add_thing(request: Request, _: str) -> Reply:
    return json_reply({"added": request.body.decode()}, 201)


async def thing(request: Request, thing_id: str) -> Reply:
    return json_reply({"id": thing_id})


async def remove_thing(request: Request, thing_id: str) -> Reply:
    return json_reply({"removed": thing_id}, 202)


async def busy(request: Request, _: str) -> Reply:
    raise Overloaded("too busy")


def find(request: Request, name: bytes) -> bytes | None:
    return next((v for k, v in request.headers if k == name), None)


def table() -> RouteTable:
    t = RouteTable()
    t.add("GET", "/things", things)
    t.add("POST", "/things", add_thing)
    t.add("GET", "/models/{model_id:path}", thing)
    t.add("POST", "/things/{thing_id}/remove", remove_thing)
    t.add("DELETE", "/things/{thing_id}", remove_thing)
    t.add("GET", "/busy", busy)
    return t


def serving(t: RouteTable) -> AbstractAsyncContextManager[Served]:
    return serve(t.handlers(), t.fallback)


async def test_unknown_paths_get_404_in_the_openai_shape_with_the_request_id() -> None:
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/nowhere", b"x-request-id: asked-1") + post("/", b"{}") + get("/things/a/b")
                  + get("/nowhere", b"x-request-id: not a token!"))
        first = await conn.response()
        assert assert_openai_error(first, 404)["message"] == "Not Found"
        assert first.headers[b"x-request-id"] == b"asked-1"
        for _ in range(2):
            assert_openai_error(await conn.response(), 404)
        fresh = await conn.response()
        assert_openai_error(fresh, 404)
        assert len(fresh.headers[b"x-request-id"]) == 32   # the client's was not a sane token: a fresh one
        assert not await conn.closed(within=0.2)   # an answered error keeps the connection
        await conn.close()


async def test_a_wrong_method_gets_405_with_allow() -> None:
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/things", method=b"PUT") + get("/things/7") + get("/models/m", method=b"DELETE")
                  + get("/things/7/remove"))
        for allow in (b"GET, HEAD, POST", b"DELETE", b"GET, HEAD", b"POST"):
            response = await conn.response()
            assert assert_openai_error(response, 405)["message"] == "Method Not Allowed"
            assert response.headers[b"allow"] == allow
        await conn.close()


def without_per_request(response: Response) -> dict[bytes, bytes]:
    return {k: v for k, v in response.headers.items() if k not in (b"date", b"x-request-id")}


async def test_head_answers_the_gets_status_and_headers_without_a_body() -> None:
    """A HEAD, then a GET on the same connection: had the HEAD carried its body, the GET's response
    would be read from the middle of it."""
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        for path, auth, status in (("/things", b"authorization: Bearer ok", 200), ("/things", b"x-no: auth", 401),
                                   ("/models/m", b"x-no: auth", 200)):
            conn.send(get(path, auth, method=b"HEAD") + get(path, auth))
            head = await conn.response(head_only=True)
            full = await conn.response()
            assert (head.status, full.status) == (status, status)
            assert without_per_request(head) == without_per_request(full)
            assert int(head.headers[b"content-length"]) == len(full.body) > 0
        assert full.json() == {"id": "m"}
        assert not await conn.closed(within=0.2)   # nothing but the GET's response came after the HEAD's head
        await conn.close()


async def test_routes_match_the_percent_decoded_path_and_take_one_parameter() -> None:
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/thing%73", b"authorization: Bearer ok") + get("/models/org%2Fmodel%20x")
                  + get("/models/org/caf%C3%A9") + post("/things/%E2%9C%93/remove", b"")
                  + get("/things/a%2Fb", method=b"DELETE") + get("/models/"))
        plain = await conn.response()
        assert (plain.status, plain.body, plain.headers[b"x-things"]) == (200, b"three things", b"3")
        assert plain.headers[b"content-type"] == b"text/plain; charset=utf-8"
        assert (await conn.response()).json() == {"id": "org/model x"}   # {name:path}: slashes included
        assert (await conn.response()).json() == {"id": "org/café"}
        removed = await conn.response()
        assert (removed.status, removed.json()) == (202, {"removed": "✓"})
        assert_openai_error(await conn.response(), 404)   # {name} is one segment of the decoded path
        assert_openai_error(await conn.response(), 404)   # {name:path} is never empty (no /models to redirect to)
        await conn.close()


async def test_an_absolute_form_target_is_served_as_its_path() -> None:
    """`GET http://host/things HTTP/1.1` (RFC 9112 §3.2.2: a server must take it; some proxies send it) was a
    404."""
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get(f"http://127.0.0.1:{s.port}/models/org/m?x=1") + get("HTTPS://example.com")
                  + get("http://example.com/things", b"authorization: Bearer ok"))
        assert (await conn.response()).json() == {"id": "org/m"}
        assert_openai_error(await conn.response(), 404)   # its path is /, which no route has
        assert (await conn.response()).body == b"three things"
        await conn.close()


async def test_a_trailing_slash_too_many_or_too_few_is_redirected() -> None:
    """Also on a {name:path} route (`/models/org/m/` was the model 'org/m/') and on the paths the server
    answers itself (the completions door's), which the table knows for this only."""
    t = table()
    t.served_elsewhere(["/v1/chat/completions"])
    async with serving(t) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/things/?x=1") + get("/busy/") + get("/models/org/m/") + post("/v1/chat/completions/", b"{}"))
        for location in (b"/things?x=1", b"/busy", b"/models/org/m", b"/v1/chat/completions"):
            response = await conn.response()
            assert (response.status, response.headers[b"location"], response.body) == (307, location, b"")
        await conn.close()


async def test_a_handlers_error_is_answered_in_the_openai_shape() -> None:
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get("/busy", b"x-request-id: busy-1") + get("/things") + post("/things", b"new"))
        busy_response = await conn.response()
        error = assert_openai_error(busy_response, 429)
        assert (error["code"], error["type"]) == ("overloaded", "rate_limit_error")
        assert busy_response.headers[b"retry-after"] == b"1"
        assert busy_response.headers[b"x-request-id"] == b"busy-1"
        assert assert_openai_error(await conn.response(), 401)["code"] == "invalid_api_key"
        added = await conn.response()
        assert (added.status, orjson.loads(added.body)) == (201, {"added": "new"})
        assert b"x-request-id" in added.headers
        await conn.close()


@pytest.mark.parametrize("path", ["/things", "/models/m"], ids=["path", "pattern"])
async def test_two_authorization_headers_get_400_on_the_tables_routes(path: str) -> None:
    async with serving(table()) as s:
        conn = await Conn.open(s.port)
        conn.send(get(path, b"authorization: Bearer ok", b"Authorization: Bearer other"))
        error = assert_openai_error(await conn.response(), 400)
        assert "Authorization" in error["message"]
        assert await conn.closed()
        await conn.close()


def test_a_route_is_added_once_with_one_parameter_at_most() -> None:
    t = table()
    for method, path in (("GET", "/things"), ("HEAD", "/things"), ("DELETE", "/things/{other_name}")):
        with pytest.raises(ValueError, match="has a route already"):
            t.add(method, path, things)
    with pytest.raises(ValueError, match="at most one"):
        t.add("GET", "/a/{x}/b/{y}", thing)
