"""The engine's spans, joined to the gateway's trace of the request.

With tracing on in the engine's own environment (the OTEL_* variables, `common.tracing`; a managed
engine inherits the gateway's), a request that carries the gateway's `traceparent` gets a span under
the gateway's dispatch span:

    engine generate     the request on this engine: its embedding wait, first token (an event), tokens
    engine encode       an Encode on this engine: its images encoded and the embeddings handed off

Requests without a traceparent, and every request with tracing off, run as before (the engine's
`generate` picks the untraced path with one check).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from common import tracing
from common.wire import engine_pb2

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


class EngineTracing:
    """The engine's tracer; built only when tracing is on (`from_env`)."""

    def __init__(self, tracer: Tracer, backend_id: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._tracer = tracer
        self._server = SpanKind.SERVER
        self._status, self._error = Status, StatusCode.ERROR
        self._attributes = {"heterogate.backend": backend_id}

    @classmethod
    def from_env(cls, backend_id: str) -> EngineTracing | None:
        setup = tracing.setup("heterogate.engine", "heterogate-engine")
        return None if setup is None else cls(setup.tracer, backend_id)

    def _start(self, name: str, traceparent: str, attributes: dict[str, Any]) -> Span:
        return self._tracer.start_span(name, tracing.parent(traceparent), self._server,
                                       {**self._attributes, **attributes})

    def _end(self, span: Span, error: BaseException | None) -> None:
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(self._status(self._error, f"{type(error).__name__}: {error}"))
        span.end()

    async def generate(
        self, request: engine_pb2.GenerateRequest, chunks: AsyncGenerator[engine_pb2.GenerateChunk, None]
    ) -> AsyncGenerator[engine_pb2.GenerateChunk, None]:
        """`chunks`, the request's, inside its span."""
        span = self._start("engine generate", request.traceparent, {
            "heterogate.request_id": request.request_id, "gen_ai.request.max_tokens": request.max_tokens,
            "heterogate.images": request.embedding_count})
        error: BaseException | None = None
        first = True
        try:
            async for chunk in chunks:
                if first:
                    span.add_event("first_token", {"heterogate.embedding_wait_s": chunk.embedding_wait_s})
                    first = False
                if chunk.finish_reason:
                    span.set_attributes({"gen_ai.usage.input_tokens": chunk.usage.prompt_tokens,
                                         "gen_ai.usage.output_tokens": chunk.usage.completion_tokens,
                                         "gen_ai.response.finish_reasons": [chunk.finish_reason]})
                yield chunk
        except BaseException as exc:
            error = exc
            raise
        finally:
            await chunks.aclose()
            self._end(span, error)

    async def encode(
        self, request: engine_pb2.EncodeRequest,
        encode: Callable[[engine_pb2.EncodeRequest], Awaitable[engine_pb2.EncodeReply]],
    ) -> engine_pb2.EncodeReply:
        """`encode(request)` inside its span."""
        span = self._start("engine encode", request.traceparent, {
            "heterogate.images": len(request.images), "heterogate.deliver_to": request.deliver_to})
        try:
            reply = await encode(request)
        except BaseException as exc:
            self._end(span, exc)
            raise
        span.set_attributes({"heterogate.image_tokens": reply.image_tokens, "heterogate.encode_s": reply.encode_s,
                             "heterogate.embedding_bytes": reply.embedding_bytes})
        self._end(span, None)
        return reply
