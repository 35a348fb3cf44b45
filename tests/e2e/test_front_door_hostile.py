"""The real gateway's front door against hostile clients: stalled bodies cut by `limits.body_timeout_s`, and
requests with two `Authorization` headers refused on every route.

One gateway, one `kind: openai` backend where nothing listens (nothing here needs an answer from an
engine), a short body timeout, API keys on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.harness import Gateway, free_port, run_gateway, write_config

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
