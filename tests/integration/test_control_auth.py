"""The control port's rules, over a real gRPC server on loopback: who may heartbeat, and what a
heartbeat may change (gateway.control.control_auth). A refused heartbeat ends with a gRPC status and its
reason, and leaves the state table as it was."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from common.catalog import load_catalog
from common.control_credentials import ControlCredentials
from common.wire import control_pb2, control_pb2_grpc
from gateway.control.control_auth import ControlAuth
from gateway.control.engine_identities import EngineIdentities
from gateway.control.heartbeat_service import ControlService
from gateway.routing.signals import LocalSignals
from gateway.routing.state_table import StateTable

TOKEN = "cluster-token-for-tests"
MANAGED, EXTERNAL = "managed-0", "ext-0"
EXTERNAL_ADDRESS = "127.0.0.1:7001"


async def control_server(auth: ControlAuth) -> tuple[grpc.aio.Server, StateTable, int]:
    catalog = load_catalog()
    table = StateTable(catalog.model("llava-1.5-7b"), 0.1)
    table.register(MANAGED, "language", catalog.gpu("H100"), address=None, managed=True)
    table.register(EXTERNAL, "language", catalog.gpu("A100-80GB"), address=EXTERNAL_ADDRESS, managed=False)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(table), auth=auth), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, table, port


async def heartbeat(port: int, backend_id: str, address: str, credentials: ControlCredentials, queue: int = 7) -> (
    control_pb2.GatewayMessage
):
    """One heartbeat; returns the gateway's ack or raises its AioRpcError."""
    async def one() -> AsyncIterator[control_pb2.BackendState]:
        yield control_pb2.BackendState(backend_id=backend_id, address=address, seq=time.monotonic_ns(),
                                         queue_depth=queue)
        await asyncio.Event().wait()   # the stream stays open, as a sender's does, until the gateway answers

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = control_pb2_grpc.ControlStub(channel).Connect(one(), metadata=credentials.metadata(), timeout=10)
        async for ack in call:
            return ack
    raise AssertionError("no ack")


async def refused(port: int, backend_id: str, address: str, credentials: ControlCredentials) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await heartbeat(port, backend_id, address, credentials)
    return info.value


async def test_token_required_when_configured() -> None:
    auth = ControlAuth(TOKEN, EngineIdentities({MANAGED: "engine-secret"}))
    server, table, port = await control_server(auth)
    try:
        for creds in (ControlCredentials(), ControlCredentials(token="wrong"), ControlCredentials(identity="x")):
            err = await refused(port, EXTERNAL, EXTERNAL_ADDRESS, creds)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "cluster token" in (err.details() or "")
        assert table.get(EXTERNAL).last_heartbeat is None   # type: ignore[union-attr]
        # With the token an external backend may report, and even move (the token is its proof).
        await heartbeat(port, EXTERNAL, "127.0.0.1:7002", ControlCredentials(token=TOKEN))
        assert table.get(EXTERNAL).address == "127.0.0.1:7002"   # type: ignore[union-attr]
    finally:
        await server.stop(None)


async def test_managed_backend_needs_its_engine_identity() -> None:
    auth = ControlAuth(TOKEN, EngineIdentities({MANAGED: "engine-secret"}))
    server, table, port = await control_server(auth)
    try:
        engine = ControlCredentials(token=TOKEN, identity="engine-secret")
        await heartbeat(port, MANAGED, "127.0.0.1:9001", engine, queue=1)
        entry = table.get(MANAGED)
        assert entry is not None and entry.address == "127.0.0.1:9001"
        before = (entry.address, entry.reported.waiting, entry.last_heartbeat)
        for impostor in (ControlCredentials(token=TOKEN), ControlCredentials(token=TOKEN, identity="guess")):
            err = await refused(port, MANAGED, "127.0.0.1:6666", impostor)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "identity" in (err.details() or "") and MANAGED in (err.details() or "")
        assert (entry.address, entry.reported.waiting, entry.last_heartbeat) == before
        # The engine itself, restarted on another port, moves its backend.
        await heartbeat(port, MANAGED, "127.0.0.1:9002", engine)
        assert entry.address == "127.0.0.1:9002"
    finally:
        await server.stop(None)


async def test_open_loopback_port_still_guards_ids_and_addresses() -> None:
    """No token configured (a loopback demo): managed ids still need their identity, and an external
    backend cannot be moved away from its address."""
    auth = ControlAuth(None, EngineIdentities({MANAGED: "engine-secret"}))
    server, table, port = await control_server(auth)
    try:
        err = await refused(port, MANAGED, "127.0.0.1:6666", ControlCredentials())
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        err = await refused(port, EXTERNAL, "127.0.0.1:6666", ControlCredentials())
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "move" in (err.details() or "")
        assert table.get(EXTERNAL).address == EXTERNAL_ADDRESS   # type: ignore[union-attr]
        await heartbeat(port, EXTERNAL, EXTERNAL_ADDRESS, ControlCredentials())   # its own address: fine
        assert table.get(EXTERNAL).last_heartbeat is not None   # type: ignore[union-attr]
        err = await refused(port, "nobody", "127.0.0.1:1", ControlCredentials())
        assert err.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)
