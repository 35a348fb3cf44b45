"""Both signal stores behind the one interface the Control service writes to (gateway/routing/signals.py):
a heartbeat stream on the real gRPC service lands in the table and opens the backend's client,
an out-of-order message changes nothing, and with the Redis store the report reaches another
replica's table through the real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import grpc
import pytest
import redis

from common.wire import control_pb2, control_pb2_grpc
from gateway.control.heartbeat_service import ControlService
from gateway.routing.signals import LocalSignals, SignalStore
from gateway.routing.state_table import StateTable
from testkit.harness import free_port
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix, replica, table

pytestmark = pytest.mark.timeout(30)
GPUS = {"h100-0": "H100"}
StoreFactory = Callable[[StateTable, Callable[[str, str], None]], AbstractAsyncContextManager[SignalStore]]


@asynccontextmanager
async def local_store(t: StateTable, opened: Callable[[str, str], None]) -> AsyncIterator[SignalStore]:
    yield LocalSignals(t, opened)


@asynccontextmanager
async def redis_store(t: StateTable, opened: Callable[[str, str], None]) -> AsyncIterator[SignalStore]:
    with redis_prefix("signals") as prefix:
        async with replica(t, prefix, "a", on_heartbeat=opened) as shared:
            yield shared


async def stream(port: int, *seqs: int) -> None:
    """One backend's heartbeats, in the order given, on one Control stream; waits for every ack."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        messages = [control_pb2.BackendState(backend_id="h100-0", address="127.0.0.1:7001", seq=s,
                                             queue_depth=s) for s in seqs]
        call = control_pb2_grpc.ControlStub(channel).Connect(iter(messages))
        acks = [m.ack_seq async for m in call]
        assert acks == list(seqs)


@pytest.mark.parametrize("store", [local_store, redis_store], ids=["in-process", "redis"])
async def test_the_control_service_writes_through_either_store(store: StoreFactory) -> None:
    t = table(GPUS)
    opened: list[tuple[str, str]] = []
    async with store(t, lambda backend_id, address: opened.append((backend_id, address))) as signals:
        server = grpc.aio.server()
        control_pb2_grpc.add_ControlServicer_to_server(ControlService(signals), server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        try:
            await stream(port, 5, 3)   # the second is older than the first: ignored
        finally:
            await server.stop(grace=None)
    entry = t.get("h100-0")
    assert entry is not None and t.is_healthy(entry)
    assert (entry.reported.seq, entry.reported.waiting, entry.address) == (5, 5, "127.0.0.1:7001")
    assert opened == [("h100-0", "127.0.0.1:7001")]


async def test_the_redis_store_hands_a_report_to_the_other_replica() -> None:
    a, b = table(GPUS), table(GPUS)
    opened_b: list[tuple[str, str]] = []
    with redis_prefix("signals-peer") as prefix:
        async with replica(a, prefix, "a") as ra, \
                replica(b, prefix, "b", on_heartbeat=lambda i, addr: opened_b.append((i, addr))) as rb:
            server = grpc.aio.server()
            control_pb2_grpc.add_ControlServicer_to_server(ControlService(ra), server)
            port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
            await server.start()
            try:
                await stream(port, 9)
            finally:
                await server.stop(grace=None)
            assert b.get("h100-0").last_heartbeat is None   # type: ignore[union-attr]
            await ra.refresh()
            await rb.refresh()
            await asyncio.sleep(0)
    entry = b.get("h100-0")
    assert entry is not None and b.is_healthy(entry)
    assert (entry.reported.seq, entry.reported.waiting, entry.address) == (9, 9, "127.0.0.1:7001")
    assert opened_b == [("h100-0", "127.0.0.1:7001")]


async def test_the_engines_port_outlives_a_redis_that_lost_its_keys() -> None:
    """The first replica's pick is every replica's port; when Redis loses the key (a restart without
    persistence), the running replicas set it again at their next refresh, so a replica started after
    that agrees on the port the engines already heartbeat to, not a port of its own."""
    with redis_prefix("engines-port") as prefix:
        async with replica(table(GPUS), prefix, "a") as ra, replica(table(GPUS), prefix, "b") as rb:
            port = await ra.engines_port(lambda: 41001)
            assert await rb.engines_port(lambda: 41002) == port == 41001
            with redis.Redis.from_url(SYSTEM_REDIS, socket_timeout=2) as r:   # what a restarted Redis holds
                r.delete(prefix + "engines_port")
            await rb.refresh()
            async with replica(table(GPUS), prefix, "c") as rc:
                assert await rc.engines_port(lambda: 41003) == 41001
