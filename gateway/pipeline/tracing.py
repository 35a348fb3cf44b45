"""The spans of one request's path through the pipeline, when tracing is on (`common.tracing`).

    chat <model>                 the request, from its arrival to its log line (SERVER; GenAI attributes);
                                 the only span of one the door refuses before the pipeline (a 400, 401, 404)
    ├── admission                its wait in the admission queue (only when it waited)
    ├── route                    one decision: policy, chosen backend, its cost terms
    └── attempt <backend>        one dispatch (CLIENT): its traceparent goes to the engine or upstream
        ├── encode <backend>     the images' encode and hand-off on a vision (or monolithic) backend
        ├── first_token          from the dispatch to its first token (hand-off wait included)
        └── stream               from the first token to the stream's end

The pipeline calls a `RequestTrace` at each stage; a request has one only when tracing is on, so with
tracing off every stage costs a check for None. One the sampler leaves out is an `UnsampledTrace`: no
spans, but each dispatch still passes the trace on (W3C Trace Context, as Envoy does): its traceparent,
the sampled flag off, in the client's trace when the client sent one, so an upstream's logs and its own
sampler see the trace the client started. Attributes follow the GenAI
semantic conventions where they fit (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.*`);
the gateway's own are under `heterogate.`. They are few on purpose: the exporter's encoding costs ~5 µs
of CPU per attribute, and what the request log line already says (limits, addresses) is left out.

Why the spans are recorded here and not made with the SDK's tracer: a span the SDK's tracer starts
and ends (sampler, limits, locks, attribute checks) cost ~40 µs of CPU, and five of them more than the
rest of the request (docs/FRONT_DOOR.md, "Tracing"). A stage here keeps its ids and times, and a span
is built once, finished, as the SDK's own `ReadableSpan` and handed to the SDK's batch processor and
OTLP exporter (~8 µs). The sampler is the SDK's, asked once per request at its root; nothing is made
current in the task's context.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common import tracing
from gateway.requests.errors import RequestError
from gateway.requests.job import DEFAULT_TENANT, GenerationJob
from gateway.routing.policies.contracts import Decision

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext, SpanKind

    from common.wire import engine_pb2

_OPERATIONS = {"chat": "chat", "text": "text_completion", "completions": "text_completion"}   # by kind or endpoint
Attributes = dict[str, Any]


def _describe(error: BaseException) -> str:
    return error.message if isinstance(error, RequestError) else f"{type(error).__name__}: {error}"


class Tracing:
    """The pipeline's tracing: each request's `RequestTrace`, and the one way its spans are exported.
    Built only when tracing is on (`from_env`)."""

    def __init__(self, setup: tracing.TraceSetup) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.sampling import Decision as Sampled
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, get_current_span

        self._setup = setup
        self._readable, self._span_context, self._current = ReadableSpan, SpanContext, get_current_span
        self._status, self._error, self._unset = Status, StatusCode.ERROR, Status()
        self._sampled = Sampled.RECORD_AND_SAMPLE
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self.server, self.client, self.internal = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL

    @classmethod
    def from_env(cls) -> Tracing | None:
        """As the OTEL_* variables say; None when tracing is off (nothing of OpenTelemetry imported)."""
        setup = tracing.setup("heterogate.gateway", "heterogate-gateway")
        return None if setup is None else cls(setup)

    def context(self, trace_id: int) -> SpanContext:
        """A new span's ids in trace `trace_id`."""
        return self._span_context(trace_id, random.getrandbits(64) or 1, False, self._flags)

    def request(self, job: GenerationJob, traceparent: str | None, age_s: float) -> RequestTrace:
        """The trace of a request that arrived `age_s` ago, under the client's `traceparent` if it sent
        one; an `UnsampledTrace` when the sampler leaves it out."""
        trace = self._root(_OPERATIONS.get(job.kind, job.kind), str(job.body.get("model") or ""), job.request_id,
                           traceparent, age_s)
        if trace.sampled:
            if job.images:
                trace.attributes["heterogate.images"] = len(job.images)
            if job.tenant != DEFAULT_TENANT:
                trace.attributes["heterogate.tenant"] = job.tenant
        return trace

    def refused(self, endpoint: str, model: str, request_id: str, traceparent: str | None, age_s: float) -> (
        RequestTrace
    ):
        """The trace of a request refused before it reached the pipeline (bad input, a key refused, an
        unknown model): its one span, which `RequestTrace.end` exports with its status."""
        return self._root(_OPERATIONS.get(endpoint, endpoint), model, request_id, traceparent, age_s)

    def _root(self, operation: str, model: str, request_id: str, traceparent: str | None, age_s: float) -> (
        RequestTrace
    ):
        name = f"{operation} {model}".strip()
        remote = tracing.parent(traceparent)
        parent = self._current(remote).get_span_context() if remote is not None else None
        trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
        # The OTEL_TRACES_SAMPLER samplers decide on the trace id and the parent: no attributes to build
        # for a request left out.
        sampled = self._setup.sampler.should_sample(remote, trace_id, name, self.server)
        if sampled.decision is not self._sampled:
            return UnsampledTrace(trace_id)
        attributes: Attributes = {"gen_ai.operation.name": operation, "heterogate.request_id": request_id}
        if model:   # "": refused before its model was read
            attributes["gen_ai.request.model"] = model
        return RequestTrace(self, self.context(trace_id), parent, name, attributes, time.time_ns() - int(age_s * 1e9))

    def emit(
        self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
        attributes: Mapping[str, Any], start_ns: int, end_ns: int, error: BaseException | str | None = None,
    ) -> None:
        """Export one finished span (marked failed with `error` when there is one)."""
        status = self._unset
        if error is not None:
            if isinstance(error, BaseException):
                attributes = {**attributes, "error.type": type(error).__name__}
                error = _describe(error)
            status = self._status(self._error, error)
        s = self._setup
        span = self._readable(name, context, parent, s.resource, attributes, kind=kind, instrumentation_scope=s.scope,
                              status=status, start_time=start_ns, end_time=end_ns)
        for processor in s.processors:
            processor.on_end(span)


class RequestTrace:
    """One request's spans (see the module's docstring)."""

    __slots__ = ("_attempt", "_parent", "_tracing", "attributes", "context", "name", "started_ns")
    sampled = True   # its spans are exported (an `UnsampledTrace`: none)

    def __init__(self, owner: Tracing, context: SpanContext, parent: SpanContext | None, name: str,
                 attributes: Attributes, started_ns: int) -> None:
        self._tracing = owner
        self.context, self._parent = context, parent
        self.name, self.attributes, self.started_ns = name, attributes, started_ns
        self._attempt: AttemptTrace | None = None   # the latest dispatch: its encodes go under it

    def admission(self, waited_s: float) -> None:
        """The request waited `waited_s` in the admission queue, until now."""
        t, now = self._tracing, time.time_ns()
        t.emit("admission", t.context(self.context.trace_id), self.context, t.internal, {}, now - int(waited_s * 1e9),
               now)

    def attempt(self, decision: Decision, number: int) -> AttemptTrace:
        """A dispatch of attempt `number` as `decision` chose it: its route span now, and its own span,
        which the engine's spans join (`AttemptTrace.traceparent`)."""
        t, now = self._tracing, time.time_ns()
        backend = decision.backend
        route: Attributes = {"heterogate.policy": decision.policy, "heterogate.backend": backend.id,
                             "heterogate.candidates": len(decision.costs)}
        for terms in decision.costs:
            if terms.backend_id == backend.id:
                route.update({"heterogate.cost.total": terms.total, "heterogate.cost.prefill": terms.prefill,
                              "heterogate.cost.queue": terms.queue})
                if terms.oom:
                    route["heterogate.cost.oom"] = terms.oom
                break
        trace_id = self.context.trace_id
        t.emit("route", t.context(trace_id), self.context, t.internal, route, now, now)
        self._attempt = AttemptTrace(t, self.context, f"attempt {backend.id}", {
            "heterogate.backend": backend.id, "heterogate.attempt": number}, now)
        return self._attempt

    def encode(self, backend_id: str, request: engine_pb2.EncodeRequest) -> EncodeTrace | None:
        """An encode of the request's images on `backend_id` (and their hand-off), under the latest
        attempt; `request` carries its traceparent."""
        parent = self._attempt.context if self._attempt is not None else self.context
        encode = EncodeTrace(self._tracing, parent, backend_id, {
            "heterogate.backend": backend_id, "heterogate.images": len(request.images),
            "heterogate.handoff": "direct" if request.deliver_to else "inline"})
        request.traceparent = tracing.traceparent(encode.context.trace_id, encode.context.span_id)
        return encode

    def end(self, status: int, prompt_tokens: int, completion_tokens: int, error: str | None) -> None:
        """The request's end, as its log line says it."""
        attributes = {**self.attributes, "http.response.status_code": status,
                      "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens}
        if status >= 400:
            attributes["error.type"] = str(status)
        self._tracing.emit(self.name, self.context, self._parent, self._tracing.server, attributes, self.started_ns,
                           time.time_ns(), (error or f"HTTP {status}") if status >= 500 else None)


class UnsampledTrace(RequestTrace):
    """A request the sampler left out: no spans, and each dispatch's traceparent in its trace with the
    sampled flag off. Its encodes carry none: vision backends are the gateway's own engines, which trace
    only sampled requests (backends/engine_tracing.py)."""

    __slots__ = ("_trace_id",)
    sampled = False

    def __init__(self, trace_id: int) -> None:   # nothing of RequestTrace's: none of its spans is made
        self._trace_id = trace_id

    def admission(self, waited_s: float) -> None:
        pass

    def attempt(self, decision: Decision, number: int) -> AttemptTrace:
        return UnsampledAttempt(tracing.traceparent(self._trace_id, random.getrandbits(64) or 1, sampled=False))

    def encode(self, backend_id: str, request: engine_pb2.EncodeRequest) -> None:
        return None

    def end(self, status: int, prompt_tokens: int, completion_tokens: int, error: str | None) -> None:
        pass


class AttemptTrace:
    """One dispatch's span and its children: the first token, then the stream."""

    __slots__ = ("_first_ns", "_parent", "_started_ns", "_tracing", "attributes", "context", "name", "traceparent")

    def __init__(self, owner: Tracing, parent: SpanContext, name: str, attributes: Attributes, started_ns: int) -> (
        None
    ):
        self._tracing, self._parent = owner, parent
        self.context = owner.context(parent.trace_id)
        self.name, self.attributes, self._started_ns = name, attributes, started_ns
        self.traceparent = tracing.traceparent(self.context.trace_id, self.context.span_id)
        self._first_ns: int | None = None

    def first_token(self, first: engine_pb2.GenerateChunk) -> None:
        """The dispatch has its first token, now."""
        t, now = self._tracing, time.time_ns()
        self._first_ns = now
        attributes: Attributes = {}   # its duration is the attempt's time to first token
        if first.embedding_wait_s:
            attributes["heterogate.handoff_wait_s"] = first.embedding_wait_s
        t.emit("first_token", t.context(self.context.trace_id), self.context, t.internal, attributes,
               self._started_ns, now)

    def end(self, completed: int, error: BaseException | None) -> None:
        """The dispatch ended: with `completed` tokens, or `error`."""
        t, now = self._tracing, time.time_ns()
        if self._first_ns is not None:
            t.emit("stream", t.context(self.context.trace_id), self.context, t.internal,
                   {"gen_ai.usage.output_tokens": completed}, self._first_ns, now, error)
        t.emit(self.name, self.context, self._parent, t.client, self.attributes, self._started_ns, now, error)


class EncodeTrace:
    """One encode's span."""

    __slots__ = ("_parent", "_started_ns", "_tracing", "attributes", "context", "name")

    def __init__(self, owner: Tracing, parent: SpanContext, backend_id: str, attributes: Attributes) -> None:
        self._tracing, self._parent = owner, parent
        self.context = owner.context(parent.trace_id)
        self.name, self.attributes, self._started_ns = f"encode {backend_id}", attributes, time.time_ns()

    def end(self, reply: engine_pb2.EncodeReply | None, error: BaseException | None) -> None:
        attributes = self.attributes
        if reply is not None:
            attributes = {**attributes, "heterogate.image_tokens": reply.image_tokens,
                          "heterogate.embedding_bytes": reply.embedding_bytes}
        t = self._tracing
        t.emit(self.name, self.context, self._parent, t.client, attributes, self._started_ns, time.time_ns(), error)


class UnsampledAttempt(AttemptTrace):
    """A dispatch of an unsampled request: its traceparent only."""

    __slots__ = ()

    def __init__(self, traceparent: str) -> None:   # nothing of AttemptTrace's: no span is made
        self.traceparent = traceparent

    def first_token(self, first: engine_pb2.GenerateChunk) -> None:
        pass

    def end(self, completed: int, error: BaseException | None) -> None:
        pass
