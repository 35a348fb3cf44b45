"""A heartbeat sender given several replicas' control addresses fails over along the list."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.catalog import load_catalog
from common.heartbeat_sender import HeartbeatSender
from common.wire import control_pb2, control_pb2_grpc
from gateway.control.heartbeat_service import ControlService
from gateway.routing.signals import LocalSignals
from gateway.routing.state_table import StateTable
from testkit.harness import free_ports

pytestmark = pytest.mark.timeout(30)
CATALOG = load_catalog()


async def control(port: int) -> tuple[grpc.aio.Server, StateTable]:
    """One replica's Control service on `port`, with a table that knows backend b0."""
    table = StateTable(CATALOG.model("llava-1.5-7b"), 0.05)
    table.register("b0", "language", CATALOG.gpu("H100"), address=None, managed=False)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(table)), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server, table


async def heard(table: StateTable, timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        entry = table.get("b0")
        if entry is not None and table.is_healthy(entry):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_sender_skips_a_dead_address_and_moves_on_when_its_replica_goes() -> None:
    dead, first, second = free_ports(3)
    sender = HeartbeatSender(f"127.0.0.1:{dead}, 127.0.0.1:{first},127.0.0.1:{second}",
                             lambda: control_pb2.BackendState(backend_id="b0", address="127.0.0.1:9"),
                             interval_s=0.05)
    server_a, table_a = await control(first)
    running = asyncio.create_task(sender.run())
    try:
        assert await heard(table_a)
        assert sender.addresses[sender.current] == f"127.0.0.1:{first}"
        server_b, table_b = await control(second)
        await server_a.stop(grace=None)
        assert await heard(table_b)
        assert sender.addresses[sender.current] == f"127.0.0.1:{second}"
        await server_b.stop(grace=None)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_no_address_is_an_error() -> None:
    with pytest.raises(ValueError):
        await HeartbeatSender(" , ", control_pb2.BackendState).run()
