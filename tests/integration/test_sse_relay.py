"""The upstream SSE reader against a real HTTP server on loopback that writes its stream in awkward pieces.

An event split across TCP writes, several events in one write, CRLF line ends, comments and a
usage-only event after the finish: the client must relay every event once, in order, with the
gateway's id and model, hold the finish until usage arrives, and reuse the connection afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
import pytest

from common.wire import engine_pb2
from gateway.clients.openai_upstream import OpenAIUpstreamClient, Upstream
from gateway.clients.upstream_http import UpstreamPool
from gateway.requests.errors import BackendFailure
from gateway.requests.job import GenerationJob


def event(i: int, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    body = {"id": "up-123", "object": "chat.completion.chunk", "model": "upstream-model", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


USAGE = (b'data: {"id":"up-123","model":"upstream-model","choices":[],'
         b'"usage":{"prompt_tokens":7,"completion_tokens":4}}\n\n')
# What the server writes, one element per write (with a pause between writes so they arrive apart).
PIECES = [
    b": keep-alive comment\n\n",
    event(0, "He")[:20],                                     # an event cut mid-line
    event(0, "He")[20:] + event(1, "llo"),                   # its tail plus a whole event in one write
    event(2, " wor").replace(b"\n\n", b"\r\n\r\n"),          # CRLF line ends
    event(3, "ld", "stop") + USAGE[:30],
    USAGE[30:] + b"data: [DONE]\n\n",
]


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connections: list[int]) -> None:
    connections.append(1)
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):   # the client closed its connection
            return
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in PIECES:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[int]]]:
    connections: list[int] = []
    server = await asyncio.start_server(lambda r, w: serve(r, w, connections), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", connections
    server.close()


def pool(url: str) -> UpstreamPool:
    return UpstreamPool(url, max_connections=8, idle_s=4.0)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def client_of(answer: Answer, model: str | None = None) -> AsyncIterator[OpenAIUpstreamClient]:
    """A client of a one-off loopback upstream that answers every connection with `answer`."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = OpenAIUpstreamClient("up", url, pool(url), Upstream(model))
    try:
        yield client
    finally:
        await client.close()
        server.close()


async def relay(client: OpenAIUpstreamClient, rid: str) -> list[engine_pb2.GenerateChunk]:
    job = GenerationJob(rid, "hi", 2, 16, kind="chat", body={"model": "served", "messages": []})
    stream = client.generate(job, handoff_timeout_s=0, first_token_timeout_s=5, timeout_s=10)
    return [chunk async for chunk in stream]


async def test_events_in_awkward_pieces_are_relayed_once_in_order(upstream: tuple[str, list[int]]) -> None:
    url, connections = upstream
    client = OpenAIUpstreamClient("up", url, pool(url), Upstream("upstream-model"))
    try:
        for rid in ("r1", "r2"):
            chunks = await relay(client, rid)
            assert "".join(c.text for c in chunks) == "Hello world"
            events = b"".join(c.relay for c in chunks).split(b"\n\n")[:-1]
            assert len(events) == 4   # the usage-only event is folded into the held finish chunk
            bodies = [orjson.loads(e.removeprefix(b"data: ")) for e in events]
            assert [b["id"] for b in bodies] == [f"chatcmpl-{rid}"] * 4
            assert [b["model"] for b in bodies] == ["served"] * 4
            assert [b["choices"][0]["delta"]["content"] for b in bodies] == ["He", "llo", " wor", "ld"]
            last = chunks[-1]
            assert last.finish_reason == "stop" and not any(c.finish_reason for c in chunks[:-1])
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, 4)
    finally:
        await client.close()
    assert len(connections) == 1, "the second request should reuse the first one's connection"


async def test_a_stream_without_a_finish_reason_is_a_backend_failure() -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + event(0, "x"))
        await writer.drain()
        writer.close()

    async with client_of(truncated) as client:
        with pytest.raises(BackendFailure, match="without a finish reason"):
            await relay(client, "r3")


@pytest.mark.parametrize("payload", [
    b'{"id":"up-1","choices":{"0":{"delta":{"content":"x"}}}}',   # choices not a list
    b'{"id":"up-1","choices":[{"delta":"x"}]}',                  # a delta that is not an object
    b'{"id":"up-1","choices":["x"]}',                            # a choice that is not an object
    b'{"id":"up-1","choices":[',                                  # not JSON
], ids=["choices-object", "delta-string", "choice-string", "truncated-json"])
async def test_a_malformed_event_is_a_backend_failure(payload: bytes) -> None:
    """The first event malformed: a retryable failure of that backend, never another exception."""
    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + b"data: " + payload + b"\n\n")
        await writer.drain()
        writer.close()

    async with client_of(malformed) as client:
        with pytest.raises(BackendFailure, match="malformed event") as failure:
            await relay(client, "r4")
    assert failure.value.retryable


async def test_a_whole_reply_passes_through_byte_for_byte_but_its_id_and_model() -> None:
    """Non-streamed: the upstream's body as it came (key order, number spelling, nested ids), with the
    gateway's completion id and the client's model name swapped in."""
    reply = (b'{"id":"up-9","object":"chat.completion","created":1,"model":"upstream-model","choices":[{"index":0,'
             b'"message":{"role":"assistant","content":"hi","tool_calls":[{"id":"call_1","type":"function"}]},'
             b'"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2},"x_score":1.50}')

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        assert orjson.loads(await reader.readexactly(length))["stream"] is False
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(reply), reply))
        await writer.drain()

    async with client_of(whole, "upstream-model") as client:
        job = GenerationJob("r5", "hi", 2, 16, kind="chat", body={"model": "served", "messages": []}, whole=True)
        chunks = [c async for c in client.generate(job, handoff_timeout_s=0, first_token_timeout_s=5, timeout_s=10)]
    assert len(chunks) == 1 and chunks[0].finish_reason == "tool_calls" and chunks[0].text == "hi"
    assert chunks[0].relay == reply.replace(b'"id":"up-9"', b'"id":"chatcmpl-r5"').replace(
        b'"model":"upstream-model"', b'"model":"served"')
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (3, 2)


async def test_every_event_gets_the_gateway_id_however_the_upstream_writes_it() -> None:
    """The swap is worked out once and reused while the upstream's id and model stay the same; an event
    whose id changed, or one not written as compact JSON, still leaves with the gateway's id and model."""
    events = [
        event(0, "a").replace(b"up-123", b"up-A"),
        event(1, "b").replace(b"up-123", b"up-B"),                               # the upstream's id changed
        b'data: {"id": "up-B", "model": "upstream-model", "choices": [{"index": 0, "delta": {"content": "c"}}]}\n\n',
        event(3, "d", "stop").replace(b"up-123", b"up-B"),
        b"data: [DONE]\n\n",
    ]

    async def serve_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD)
        for e in events:
            writer.write(e)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    async with client_of(serve_events, "upstream-model") as client:
        chunks = await relay(client, "r6")
    bodies = [orjson.loads(e.removeprefix(b"data: ")) for e in b"".join(c.relay for c in chunks).split(b"\n\n")[:-1]]
    assert [(b["id"], b["model"]) for b in bodies] == [("chatcmpl-r6", "served")] * 4
    assert "".join(c.text for c in chunks) == "abcd"
