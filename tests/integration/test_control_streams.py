"""The control port against strangers, over a real gRPC server on loopback: a stream is authenticated on
its first message whatever it holds, before any ack; a message that names no backend or is no
BackendState ends the stream with INVALID_ARGUMENT (no traceback); and one heartbeat with the largest
seq cannot knock a backend out of routing (gateway.control.heartbeat_service)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from structlog.testing import capture_logs

from common.catalog import load_catalog
from common.wire import control_pb2, control_pb2_grpc
from gateway.control.control_auth import ControlAuth
from gateway.control.heartbeat_service import ControlService, add_control_service
from gateway.routing.signals import LocalSignals
from gateway.routing.state_table import StateTable

pytestmark = pytest.mark.timeout(30)

TOKEN = "cluster-token-for-tests"
EXTERNAL, EXTERNAL_ADDRESS, PID = "ext-0", "127.0.0.1:7001", 4242
TOP = (1 << 64) - 1
CONNECT = "/heterogate.control.v1.Control/Connect"
Metadata = Sequence[tuple[str, str]]
BEARER: Metadata = (("authorization", f"Bearer {TOKEN}"),)


async def control_server(auth: ControlAuth) -> tuple[grpc.aio.Server, StateTable, int]:
    """The Control service on a free loopback port, registered as the daemon registers it."""
    catalog = load_catalog()
    table = StateTable(catalog.model("llava-1.5-7b"), 0.1)
    table.register(EXTERNAL, "language", catalog.gpu("A100-80GB"), address=EXTERNAL_ADDRESS, managed=False)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_control_service(server, ControlService(LocalSignals(table), auth=auth))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, table, port


class Stream:
    """One Connect stream that the test writes message by message, reading the gateway's answer to each."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata = ()) -> None:
        self.call = control_pb2_grpc.ControlStub(channel).Connect(metadata=tuple(metadata), timeout=10)

    async def send(self, **fields: object) -> control_pb2.GatewayMessage:
        await self.call.write(control_pb2.BackendState(**fields))  # type: ignore[arg-type]
        ack = await self.call.read()
        assert isinstance(ack, control_pb2.GatewayMessage), ack
        return ack

    async def refused(self, **fields: object) -> grpc.aio.AioRpcError:
        """The gateway's refusal of the stream, whose first answer to this message must be it."""
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.send(**fields)
        return info.value


def engine(seq: int, queue: int) -> dict[str, object]:
    return {"backend_id": EXTERNAL, "address": EXTERNAL_ADDRESS, "pid": PID, "seq": seq, "queue_depth": queue}


async def test_one_heartbeat_with_the_largest_seq_does_not_wedge_an_external_backend() -> None:
    """Open loopback port: anyone may report for an external backend at its own address. An impostor
    with the engine's pid, its address and seq 2^64-1 displaces one report; the engine's next heartbeat
    is taken, and its own stream is still ordered."""
    server, table, port = await control_server(ControlAuth(None))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            real = Stream(channel)
            await real.send(**engine(1_000, 1))
            impostor = Stream(channel)
            await impostor.send(**engine(TOP, 50))
            await impostor.call.done_writing()
            await real.send(**engine(1_001, 2))
            entry = table.get(EXTERNAL)
            assert entry is not None and (entry.reported.seq, entry.reported.waiting) == (1_001, 2)
            await real.send(**engine(1_000, 9))   # a reordered message of the engine's own: dropped
            assert (entry.reported.seq, entry.reported.waiting) == (1_001, 2)
            await real.send(**engine(1_002, 3))
            assert (entry.reported.seq, entry.reported.waiting) == (1_002, 3)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("first", [
    {},                                                    # nothing at all
    {"seq": 1, "queue_depth": 99},                         # load, for no backend
    {"backend_id": EXTERNAL, "address": EXTERNAL_ADDRESS, "seq": 1},
])
async def test_a_stream_without_the_token_is_refused_on_its_first_message_whatever_it_holds(
    first: dict[str, object],
) -> None:
    server, table, port = await control_server(ControlAuth(TOKEN))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            err = await Stream(channel).refused(**first)   # no ack before the refusal
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "cluster token" in (err.details() or "")
        assert table.get(EXTERNAL).last_heartbeat is None  # type: ignore[union-attr]
    finally:
        await server.stop(None)


@pytest.mark.parametrize("token", [TOKEN, None])
async def test_a_message_that_names_no_backend_ends_the_stream(token: str | None) -> None:
    server, table, port = await control_server(ControlAuth(token))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            err = await Stream(channel, BEARER if token else ()).refused(seq=1, queue_depth=99)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "backend_id" in (err.details() or "")
            # nor may a named stream go on without a name
            stream = Stream(channel, BEARER if token else ())
            await stream.send(**engine(1, 1))
            err = await stream.refused(seq=2, queue_depth=99)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert table.get(EXTERNAL).reported.waiting == 1  # type: ignore[union-attr]
    finally:
        await server.stop(None)


async def garbage(port: int, metadata: Metadata) -> grpc.aio.AioRpcError:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"\xff\xff\xff\xff\x0f"

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        connect = channel.stream_stream(CONNECT, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in connect(chunks(), metadata=tuple(metadata), timeout=10):
                pass
    return info.value


async def test_bytes_that_are_no_backend_state_end_with_invalid_argument_after_authentication(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, _, port = await control_server(ControlAuth(TOKEN))
    try:
        with caplog.at_level(logging.ERROR):
            err = await garbage(port, ())   # a stranger learns nothing but that it needs the token
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            err = await garbage(port, BEARER)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "BackendState" in (err.details() or "")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        await server.stop(None)


async def test_a_second_live_stream_cannot_claim_a_backend_from_another_address() -> None:
    """Two agents for one backend, each at its own address, were both taken: the backend's address flipped
    between them with every heartbeat. The second is refused while the first lives, and once the first
    ends it may move the backend. A heartbeat for a backend the gateway does not have is logged, as the
    other refusals are (it was refused silently)."""
    server, table, port = await control_server(ControlAuth(TOKEN))
    moved = "127.0.0.1:7999"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            first = Stream(channel, BEARER)
            await first.send(**engine(1, 1))
            second = Stream(channel, BEARER)
            refusal = await second.refused(**{**engine(1, 9), "address": moved})
            assert refusal.code() == grpc.StatusCode.ALREADY_EXISTS
            assert f"reported by another live stream, from '{EXTERNAL_ADDRESS}'" in (refusal.details() or "")
            entry = table.get(EXTERNAL)
            assert entry is not None and entry.address == EXTERNAL_ADDRESS and entry.reported.waiting == 1
            await first.call.done_writing()
            while await first.call.read() is not grpc.aio.EOF:   # the first stream ends
                pass
            await Stream(channel, BEARER).send(**{**engine(2, 3), "address": moved})
            assert entry.address == moved and entry.reported.waiting == 3
            with capture_logs() as logs:
                ghost = await Stream(channel, BEARER).refused(**{**engine(1, 1), "backend_id": "ghost"})
            assert ghost.code() == grpc.StatusCode.NOT_FOUND
            assert [(e["event"], e["backend"]) for e in logs if e["log_level"] == "warning"] == [
                ("heartbeat_refused", "ghost")]
    finally:
        await server.stop(None)
