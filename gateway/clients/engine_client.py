"""gRPC clients of the engines: one pooled channel per backend address, errors mapped at the boundary.

Generation goes over one long-lived multiplexed Session stream per engine (gateway/clients/engine_stream.py);
Encode stays a unary call (one per image batch, megabytes each).

grpc.aio errors become `BackendFailure` (retryable unless the engine said the request itself is bad)
or `BackendTimeout`. Clients are made by `EngineClients`' factory at start-up and on address changes
(`client_factory` makes the real ones; a test gives fakes), and closed at shutdown; nothing else in the
gateway touches grpc.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol, cast

import grpc

from common.grpc_keepalive import keepalive
from common.wire import engine_pb2, engine_pb2_grpc
from gateway.clients.engine_fields import check_engine_can_honour
from gateway.clients.engine_stream import EngineStream, Failed
from gateway.clients.openai_upstream import OpenAIUpstreamClient, Upstream
from gateway.clients.upstream_http import UpstreamPool
from gateway.requests.errors import BackendFailure, BackendTimeout, InvalidRequest
from gateway.requests.job import GenerationJob, Handoff

# Engine answers that mean "this request is wrong", not "this engine is broken": never retried.
HANDOFF_TIMEOUT = "handoff_timeout"
_CLIENT_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),   # inline embeddings of large images
    ("grpc.max_send_message_length", 64 << 20),
]


def map_rpc_error(exc: grpc.aio.AioRpcError, backend_id: str, *, retryable: bool) -> Exception:
    return map_status(exc.code(), exc.details() or "", backend_id, retryable=retryable)


def map_status(code: grpc.StatusCode, details: str, backend_id: str, *, retryable: bool) -> Exception:
    detail = f"backend {backend_id}: {code.name.lower()}: {details}"
    if code in _CLIENT_FAULTS:
        return InvalidRequest(details or "rejected by the engine")
    if code == grpc.StatusCode.ABORTED:   # the engine gave up waiting for embeddings: a vision-side fault
        return BackendFailure(detail, backend_id=backend_id, retryable=retryable, code=HANDOFF_TIMEOUT)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BackendTimeout(detail, backend_id=backend_id, retryable=retryable)
    return BackendFailure(detail, backend_id=backend_id, retryable=retryable)


class EngineClient:
    handoff: Handoff = "direct"   # a vision engine delivers embeddings to this engine by DeliverEmbedding

    def __init__(self, backend_id: str, address: str) -> None:
        self.backend_id = backend_id
        self.address = address
        # Pings at the interval the engines' servers accept (common/grpc_keepalive.py).
        self._channel = grpc.aio.insecure_channel(address, options=[*keepalive().client_options(), *_CHANNEL_OPTIONS])
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._stream = EngineStream(self._stub)

    async def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """Stream chunks over the engine's Session. Failures before the first chunk are retryable;
        closing early cancels the request on the engine."""
        check_engine_can_honour(job.body, exact=bool(job.token_ids), chat=job.kind == "chat")
        request = engine_pb2.GenerateRequest(
            request_id=job.request_id, prompt=job.prompt, prompt_tokens=job.prompt_tokens,
            image_tokens=job.image_tokens, max_tokens=job.max_tokens, temperature=job.temperature,
            embedding_count=len(job.images), embedding_timeout_ms=int(handoff_timeout_s * 1000),
            handoff_key=handoff_key, whole=job.whole, token_ids=job.token_ids,
            image_keys=[engine_pb2.ImageKey(digest=d, tokens=t, place=p) for d, t, p in job.placed_images()],
            image_spans=[engine_pb2.ImageSpan(start=a, length=n, grid_thw=g) for (a, n), g in
                         zip(job.image_spans, job.image_grids or [()] * len(job.image_spans), strict=True)],
            top_p=job.top_p,
            seed=job.seed, stop=job.stop, traceparent=job.traceparent, cache_salt=job.cache_salt,
        )
        tag, inbox = self._stream.start(request, first_token_timeout_s, timeout_s)
        try:
            while True:
                chunk = await inbox.next()
                yield chunk
                if chunk.finish_reason:
                    return
        except Failed as exc:
            if inbox.first_token_timeout:
                raise BackendTimeout(
                    f"backend {self.backend_id}: no first token within {first_token_timeout_s:g} s",
                    backend_id=self.backend_id,
                ) from None
            raise map_status(exc.code, exc.detail, self.backend_id, retryable=not inbox.started) from None
        finally:
            self._stream.finish(tag)

    async def encode(self, request: engine_pb2.EncodeRequest, *, timeout_s: float) -> engine_pb2.EncodeReply:
        try:
            reply: engine_pb2.EncodeReply = await self._stub.Encode(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, self.backend_id, retryable=True) from None
        return reply

    async def close(self) -> None:
        await self._stream.close()
        await self._channel.close()


class BackendClient(Protocol):
    """How a backend gets image embeddings (`handoff`): direct from the vision engine, inline in the
    request once encoded (`job.embeddings`), or none (it encodes its own images)."""

    backend_id: str
    address: str
    handoff: Handoff

    def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]: ...

    async def close(self) -> None: ...


class EncoderClient(BackendClient, Protocol):
    """A backend that speaks the engine protocol (handoff "direct"): it also encodes images."""

    async def encode(self, request: engine_pb2.EncodeRequest, *, timeout_s: float) -> engine_pb2.EncodeReply: ...


# (backend id, address) -> its client
ClientFactory = Callable[[str, str], BackendClient]


def client_factory(
    upstreams: Mapping[str, Upstream] | None = None, *, upstream_idle_s: float = 4.0,
    upstream_max_connections: int = 1024,
) -> ClientFactory:
    """The real clients: `kind: engine` backends get a gRPC client; `kind: openai` backends (those in
    `upstreams`) an HTTP client with its own pool of keep-alive connections (`gateway.clients.upstream_http`).
    `upstreams` is read at each call, not copied, so that backends added at runtime are made the same way."""
    known: Mapping[str, Upstream] = upstreams if upstreams is not None else {}

    def make(backend_id: str, address: str) -> BackendClient:
        upstream = known.get(backend_id)
        if upstream is None:
            return EngineClient(backend_id, address)
        # Each connection may stay pooled: a closed loop of c requests needs c live connections, and
        # one dropped is a new handshake next time.
        pool = UpstreamPool(address, max_connections=upstream_max_connections, idle_s=upstream_idle_s)
        return OpenAIUpstreamClient(backend_id, address, pool, upstream)

    return make


class EngineClients:
    """The pool: one client per backend, made by `factory` (the real clients by default), replaced
    when a backend reports a new address."""

    def __init__(self, factory: ClientFactory | None = None) -> None:
        self._clients: dict[str, BackendClient] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._factory = factory or client_factory()

    def get(self, backend_id: str) -> BackendClient | None:
        return self._clients.get(backend_id)

    def engine(self, backend_id: str) -> EncoderClient | None:
        """The client of a backend that speaks the engine protocol (vision pool, hand-offs)."""
        client = self._clients.get(backend_id)
        return cast(EncoderClient, client) if client is not None and client.handoff == "direct" else None

    def ensure(self, backend_id: str, address: str) -> None:
        """Called on every heartbeat: a no-op unless the backend moved (e.g. a restarted engine)."""
        current = self._clients.get(backend_id)
        if current is not None and current.address == address.rstrip("/"):
            return
        self.put(backend_id, self._factory(backend_id, address))

    def put(self, backend_id: str, client: BackendClient | None) -> None:
        """Install `client` for the backend (None: forget it, the backend left the fleet), closing the
        one it replaces in the background."""
        current = self._clients.pop(backend_id, None)
        if client is not None:
            self._clients[backend_id] = client
        if current is not None:
            task = asyncio.create_task(current.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()), *self._closing)
        self._clients.clear()
