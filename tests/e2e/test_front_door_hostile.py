"""The real gateway's front door against hostile clients and broken backends: stalled bodies cut by
`limits.body_timeout_s`; requests with two `Authorization` headers refused on every route, on both
doors; wrong methods, unknown paths, HEAD and percent-escapes on the routes of the route table; a
backend that cannot be reached reported in the gateway's words, never gRPC's.

`gw`: one `kind: openai` backend where nothing listens (nothing there needs an engine's answer), a
short body timeout, API keys on. `unreachable_gw`: one external engine that heartbeats (from this
test) an address where nothing listens, so every dispatch fails in gRPC's connect.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest

from common.heartbeat_sender import HeartbeatSender
from common.wire import control_pb2, inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, free_port, run_gateway, write_config

pytestmark = pytest.mark.timeout(60)

BODY_TIMEOUT_S = 0.5
KEY, ADMIN_KEY = "user-key", "admin-key"
IO_S = 10.0
CHAT = {"model": "llava-1.5-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("hostile")
    config = write_config(tmp, {
        "model": "llava-1.5-7b",
        "gateway": {"limits": {"body_timeout_s": BODY_TIMEOUT_S},
                    "auth": {"api_keys_env": "HOSTILE_KEYS", "admin_keys_env": "HOSTILE_ADMIN_KEYS",
                             "cluster_token_env": "HOSTILE_CLUSTER_TOKEN"}},
        "backends": [{"id": "up0", "kind": "openai", "gpu": "H100", "address": f"http://127.0.0.1:{free_port()}"}],
    })
    env = {"HOSTILE_KEYS": KEY, "HOSTILE_ADMIN_KEYS": ADMIN_KEY, "HOSTILE_CLUSTER_TOKEN": "cluster-token"}
    with run_gateway(config, healthy=0, admin_key=ADMIN_KEY, env=env) as gateway:
        yield gateway


def port_of(gw: Gateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, object], bool]:
    """Sends `data` on a fresh connection; the status and JSON body of the answer, and whether the
    connection was closed after it."""
    async with asyncio.timeout(IO_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            body = orjson.loads(await reader.readexactly(length))
            closed = await reader.read() == b""
        finally:
            writer.close()
    return status, body, closed


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/admin/backends"])
def test_a_stalled_body_gets_408_and_the_gateway_serves_on(gw: Gateway, path: str) -> None:
    head = (b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{\"model\": " % (path.encode(), KEY.encode()))
    status, body, closed = asyncio.run(exchange(port_of(gw), head))
    assert status == 408 and closed
    assert set(body) == {"error"} and "body" in body["error"]["message"]   # type: ignore[operator]
    assert httpx.get(f"{gw.url}/health", timeout=IO_S).status_code == 200


def test_many_stalled_bodies_are_all_cut(gw: Gateway) -> None:
    """Each holds a connection and its bytes only until the deadline: all are answered and closed."""
    socks = []
    for _ in range(50):
        sock = socket.create_connection(("127.0.0.1", port_of(gw)), timeout=IO_S)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b" " * 50_000)
        socks.append(sock)
    try:
        for sock in socks:
            answer = b""
            while chunk := sock.recv(65536):   # to the close
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 ")
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{gw.url}/health", timeout=IO_S).status_code == 200


# -- two Authorization headers ----------------------------------------------------------------------

ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/models/llava-1.5-7b"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"),
          ("GET", "/admin/backends"), ("GET", "/no-such-route")]


@pytest.mark.parametrize("method, path", ROUTES, ids=[p for _, p in ROUTES])
@pytest.mark.parametrize("keys", [(ADMIN_KEY, "wrong"), ("wrong", ADMIN_KEY), (ADMIN_KEY, ADMIN_KEY)],
                         ids=["good-first", "good-second", "both-good"])
def test_two_authorization_headers_get_400_on_every_route(gw: Gateway, method: str, path: str,
                                                          keys: tuple[str, str]) -> None:
    body = orjson.dumps(CHAT) if method == "POST" else b""
    request = (b"%s %s HTTP/1.1\r\nhost: x\r\nAuthorization: Bearer %s\r\nauthorization: Bearer %s\r\n"
               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
               % (method.encode(), path.encode(), keys[0].encode(), keys[1].encode(), len(body), body))
    status, answer, closed = asyncio.run(exchange(port_of(gw), request))
    assert status == 400 and closed
    error = answer["error"]
    assert isinstance(error, dict) and "Authorization" in error["message"]
    assert error["type"] == "invalid_request_error"
    # one header with either key is read as it always was
    one = httpx.get(f"{gw.url}/admin/backends", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=IO_S)
    assert one.status_code == 200


def test_the_route_tables_answers_on_the_real_gateway(gw: Gateway) -> None:
    user, admin = {"authorization": f"Bearer {KEY}"}, {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=gw.url, timeout=IO_S) as c:
        for path, keys in (("/v1/models", user), ("/metrics", admin), ("/dashboard", {})):
            got, head = c.get(path, headers=keys), c.head(path, headers=keys)
            assert (got.status_code, head.status_code, head.content) == (200, 200, b"")
            assert head.headers["content-type"] == got.headers["content-type"]
            assert int(head.headers["content-length"]) > 0
        refused = c.head("/v1/models")
        assert (refused.status_code, refused.content) == (401, b"")
        model = c.get("/v1/models/llava%2D1.5-7b", headers={**user, "x-request-id": "routes-1"})
        assert (model.json()["id"], model.headers["x-request-id"]) == ("llava-1.5-7b", "routes-1")
        for method, path, allow in (("POST", "/health", "GET, HEAD"), ("DELETE", "/admin/backends", "GET, HEAD, POST"),
                                    ("GET", "/admin/backends/up0/drain", "POST"), ("PUT", "/v1/completions", "POST")):
            wrong = c.request(method, path, headers=admin)
            assert (wrong.status_code, wrong.headers["allow"]) == (405, allow)
            assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}
        for method, path, there in (("GET", "/v1/models/", "/v1/models"),   # was model '' not found
                                    ("GET", "/v1/models/llava-1.5-7b/", "/v1/models/llava-1.5-7b"),
                                    ("POST", "/v1/chat/completions/", "/v1/chat/completions"),   # was a 404
                                    ("POST", "/v1/completions/", "/v1/completions")):
            slashed = c.request(method, path, headers=user, json={})
            assert (slashed.status_code, slashed.headers["location"]) == (307, there), (path, slashed.text)
        unknown = c.get("/v1/nope", headers=user)
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "Not Found"
        assert "x-request-id" in unknown.headers


def test_two_authorization_entries_on_the_grpc_door(gw: Gateway) -> None:
    async def generate(metadata: tuple[tuple[str, str], ...]) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(model="llava-1.5-7b", prompt="hi", max_tokens=2),
                metadata=metadata, timeout=IO_S)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in call]
            return info.value

    err = asyncio.run(generate((("authorization", f"Bearer {KEY}"), ("authorization", "Bearer wrong"))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "authorization" in (err.details() or "")
    # one entry passes the key check (and then finds the backend down)
    err = asyncio.run(generate((("authorization", f"Bearer {KEY}"),)))
    assert err.code() != grpc.StatusCode.INVALID_ARGUMENT and err.code() != grpc.StatusCode.UNAUTHENTICATED


def test_bytes_that_are_no_message_and_a_prompt_beside_messages_are_invalid_argument(gw: Gateway) -> None:
    """Not UNKNOWN with a traceback in the gateway's log: INVALID_ARGUMENT naming what is wrong."""
    async def generate(raw: bytes) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
            call = channel.unary_stream("/heterogate.inference.v1.Inference/Generate")(
                raw, metadata=(("authorization", f"Bearer {KEY}"),), timeout=IO_S)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in call]
            return info.value

    err = asyncio.run(generate(b"\xff\xff\xff\x00garbage"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in (err.details() or "")
    both = inference_pb2.GenerateRequest(model="llava-1.5-7b", prompt="hi", max_tokens=2,
                                         messages=[inference_pb2.Message(role="user", text="hi")])
    err = asyncio.run(generate(both.SerializeToString()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in (err.details() or "")
    assert "Traceback" not in gw.log_path.read_text()


# -- a backend that cannot be reached ---------------------------------------------------------------

GRPC_TEXTS = ("AioRpcError", "ailed to connect", "Cancelling", "ipv4:", "127.0.0.1", "StatusCode", "errno")


@pytest.fixture(scope="module")
def unreachable_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """An external engine that heartbeats an address where nothing listens."""
    tmp: Path = tmp_path_factory.mktemp("unreachable")
    dead = f"127.0.0.1:{free_port()}"
    config = write_config(tmp, {
        "model": "llava-1.5-7b", "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 50},
        "backends": [{"id": "ext-0", "role": "language", "gpu": "H100", "address": dead}],
    })
    stop = threading.Event()

    def state() -> control_pb2.BackendState:
        return control_pb2.BackendState(backend_id="ext-0", address=dead, role=control_pb2.ROLE_LANGUAGE,
                                        kv_free_bytes=40 << 30, kv_total_bytes=40 << 30, max_model_len=4096)

    def beat(grpc_port: int) -> None:
        async def run() -> None:
            task = asyncio.create_task(HeartbeatSender(f"127.0.0.1:{grpc_port}", state, interval_s=0.1).run())
            while not stop.is_set():  # noqa: ASYNC110 (a thread's event)
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        asyncio.run(run())

    with run_gateway(config, healthy=0) as gateway:
        thread = threading.Thread(target=beat, args=(gateway.grpc_port,), daemon=True)
        thread.start()
        try:
            gateway.wait_until(lambda: gateway.backend("ext-0")["healthy"])
            yield gateway
        finally:
            stop.set()
            thread.join(IO_S)


def assert_clean(message: str) -> None:
    assert message and not any(t.lower() in message.lower() for t in GRPC_TEXTS), message
    assert "ext-0" in message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_unreachable_engine_is_named_without_grpc_text(unreachable_gw: Gateway, stream: bool) -> None:
    resp = httpx.post(f"{unreachable_gw.url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["code"] == "backend_failure" and error["type"] == "backend_error"
    assert_clean(error["message"])
    # the gateway's log keeps what gRPC said, for the operator
    assert "ext-0" in unreachable_gw.log_path.read_text(errors="replace")


def test_an_unreachable_engine_on_the_grpc_door(unreachable_gw: Gateway) -> None:
    async def generate() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{unreachable_gw.grpc_port}") as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(model="llava-1.5-7b", prompt="hi", max_tokens=2), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in call]
            return info.value

    err = asyncio.run(generate())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert_clean(err.details() or "")
