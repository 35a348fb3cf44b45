"""gRPC Control service: backends push their state on one long-lived stream each.

Every stream passes `ControlAuth` first (cluster token, engine identity, address moves); a refused
stream ends with UNAUTHENTICATED or PERMISSION_DENIED and the reason, and changes nothing. The token is
checked on a stream's first message, whatever it holds, before any answer; then a message that names
no backend, or bytes that are no BackendState (with `add_control_service`'s decoder), end the stream
with INVALID_ARGUMENT, and one that names a backend the gateway does not have with NOT_FOUND (logged, as
every refusal is). A stream that claims a backend another live stream reports from another address ends
with ALREADY_EXISTS: two agents for one backend would flip its address with every heartbeat; a move
takes effect once the stream reporting the old address ends.

Each stream reports under a key of its own (`StateTable.reporting_on`): heartbeat sequence numbers
order one stream's messages, so a message on another stream cannot wedge a backend's with a large seq.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import grpc
import structlog

from common.engine_scraper import KV_SOURCES
from common.grpc_decoding import lenient, register
from common.metric_tables import KvSource
from common.wire import control_pb2, control_pb2_grpc
from gateway.control.control_auth import ControlAuth
from gateway.routing.backend_entry import Reported
from gateway.routing.signals import SignalStore

log = structlog.get_logger("heartbeat")

KV_SOURCE_NAMES: dict[int, KvSource] = {wire: name for name, wire in KV_SOURCES.items()}


def reported_from(msg: control_pb2.BackendState) -> Reported:
    return Reported(
        seq=msg.seq,
        waiting=msg.queue_depth,
        running=msg.running,
        kv_free_bytes=msg.kv_free_bytes,
        kv_total_bytes=msg.kv_total_bytes,
        vision_backlog=msg.vision_backlog,
        mean_service_s=msg.mean_service_s,
        tokens_generated=msg.tokens_generated,
        requests_completed=msg.requests_completed,
        images_encoded=msg.images_encoded,
        pid=msg.pid,
        steal_episodes=msg.steal_episodes,
        tokens_stolen=msg.tokens_stolen,
        embedding_bytes_sent=msg.embedding_bytes_sent,
        max_model_len=msg.max_model_len,
        kv_source=KV_SOURCE_NAMES.get(msg.kv_capacity_source),
        prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits,
        kv_block_tokens=msg.kv_block_tokens,
        embedding_cache_hits=msg.embedding_cache_hits,
        embedding_cache_images=msg.embedding_cache_images if msg.HasField("embedding_cache_images") else None,
        scrape_error=msg.scrape_error,
    )


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(self, signals: SignalStore, auth: ControlAuth | None = None) -> None:
        """`signals`: where the reports go (this process's table, or that and the other replicas')."""
        self._signals = signals
        self._table = signals.table
        self._auth = auth or ControlAuth()
        self._streams = itertools.count(1)   # each stream's key in the table (`reporting_on`)
        # per backend, the stream reporting on it now and the address it reports: a second stream claiming
        # the backend from another address is refused while the first lives (the address flipped between them)
        self._live: dict[str, tuple[int, str]] = {}

    async def Connect(
        self, request_iterator: AsyncIterator[control_pb2.BackendState | None], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[control_pb2.GatewayMessage]:
        """`request_iterator` yields None for bytes that are no BackendState (`add_control_service`)."""
        interval_ms = int(self._table.heartbeat_interval_s * 1000)
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        stream = next(self._streams)
        backend_id: str | None = None   # as named by the stream (None: not yet)
        address = ""
        # Checked once the first message is in: a refusal sent before the client's first write lands
        # reaches the client as a failed write (INTERNAL), not as the refusal.
        try:
            async for msg in request_iterator:
                if backend_id is None:   # the first message, whatever it holds
                    refusal = self._auth.authenticate(metadata)
                    if refusal is not None:
                        log.warning("heartbeat_refused", peer=context.peer(), reason=refusal.message)
                        await context.abort(refusal.code, refusal.message)
                if msg is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "the message is no heterogate.control.v1.BackendState")
                    return
                if not msg.backend_id:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "the heartbeat names no backend: set backend_id to its id in the gateway's "
                                        "backends file")
                    return
                if msg.backend_id != backend_id or msg.address != address:
                    known = self._table.get(msg.backend_id)
                    if known is None:
                        reason = f"backend {msg.backend_id!r} is not in the gateway's backends file"
                        log.warning("heartbeat_refused", backend=msg.backend_id, peer=context.peer(), reason=reason)
                        await context.abort(grpc.StatusCode.NOT_FOUND, reason)
                        return
                    refusal = self._auth.admit(known, msg.address, metadata)
                    if refusal is not None:
                        log.warning("heartbeat_refused", backend=msg.backend_id, peer=context.peer(),
                                    reason=refusal.message)
                        await context.abort(refusal.code, refusal.message)
                    other = self._live.get(msg.backend_id)
                    if other is not None and other[0] != stream and other[1] != msg.address:
                        reason = (f"backend {msg.backend_id!r} is reported by another live stream, from {other[1]!r}: "
                                  "stop that agent first (a move takes effect once the stream reporting the old "
                                  "address ends)")
                        log.warning("heartbeat_refused", backend=msg.backend_id, peer=context.peer(), reason=reason)
                        await context.abort(grpc.StatusCode.ALREADY_EXISTS, reason)
                    if backend_id is not None and self._live.get(backend_id, (0, ""))[0] == stream:
                        del self._live[backend_id]   # the stream now reports another backend
                    if msg.backend_id != backend_id:
                        log.info("backend_connected", backend=msg.backend_id, address=msg.address)
                    backend_id, address = msg.backend_id, msg.address
                    self._live[backend_id] = (stream, address)
                with self._table.reporting_on(stream):
                    self._signals.heartbeat(backend_id, msg.seq, msg.address, reported_from(msg))
                yield control_pb2.GatewayMessage(ack_seq=msg.seq, heartbeat_interval_ms=interval_ms)
        finally:   # the stream ended (or was refused): another may report on its backend now
            if backend_id is not None and self._live.get(backend_id, (0, ""))[0] == stream:
                del self._live[backend_id]


def add_control_service(server: grpc.aio.Server, service: ControlService) -> None:
    """As control_pb2_grpc.add_ControlServicer_to_server registers `service`, but with a lenient decoder:
    bytes that are no BackendState reach the servicer as None and end the stream with INVALID_ARGUMENT once
    it is authenticated, not with UNKNOWN and a logged traceback (`common.grpc_decoding`)."""
    handlers = {"Connect": grpc.stream_stream_rpc_method_handler(
        service.Connect, request_deserializer=lenient(control_pb2.BackendState),
        response_serializer=control_pb2.GatewayMessage.SerializeToString)}
    register(server, control_pb2.DESCRIPTOR.services_by_name["Control"].full_name, handlers)
