"""gRPC Control service: backends push their state on one long-lived stream each.

Every stream passes `ControlAuth` first (cluster token, engine identity, address moves); a refused
stream ends with UNAUTHENTICATED or PERMISSION_DENIED and the reason, and changes nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from common.engine_scraper import KV_SOURCES
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

    async def Connect(
        self, request_iterator: AsyncIterator[control_pb2.BackendState], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[control_pb2.GatewayMessage]:
        interval_ms = int(self._table.heartbeat_interval_s * 1000)
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        backend_id, address = "", ""
        # Checked once the first message is in: a refusal sent before the client's first write lands
        # reaches the client as a failed write (INTERNAL), not as the refusal.
        async for msg in request_iterator:
            if msg.backend_id != backend_id or msg.address != address:
                refusal = self._auth.authenticate(metadata)
                if refusal is not None:
                    log.warning("heartbeat_refused", peer=context.peer(), reason=refusal.message)
                    await context.abort(refusal.code, refusal.message)
                known = self._table.get(msg.backend_id)
                if known is None:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND, f"backend {msg.backend_id!r} is not in the gateway's backends file"
                    )
                    return
                refusal = self._auth.admit(known, msg.address, metadata)
                if refusal is not None:
                    log.warning("heartbeat_refused", backend=msg.backend_id, peer=context.peer(),
                                reason=refusal.message)
                    await context.abort(refusal.code, refusal.message)
                if msg.backend_id != backend_id:
                    log.info("backend_connected", backend=msg.backend_id, address=msg.address)
                backend_id, address = msg.backend_id, msg.address
            self._signals.heartbeat(backend_id, msg.seq, msg.address, reported_from(msg))
            yield control_pb2.GatewayMessage(ack_seq=msg.seq, heartbeat_interval_ms=interval_ms)
