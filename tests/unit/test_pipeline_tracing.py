"""The pipeline's spans where the end-to-end test (tests/e2e/test_tracing.py) cannot steer the path: a
retry, a re-encode and an admission wait, on the fake engines and test clock of tests/unit/test_pipeline.py,
exported to the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common.tracing import TraceSetup, setup
from gateway.config.sections import BreakerConfig
from gateway.pipeline.request_log import RequestLog
from gateway.pipeline.tracing import Tracing
from gateway.routing.backend_entry import Reported
from tests.unit.test_pipeline import Rig, drain, fails, job, record, rig, serves, until

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


def traced(r: Rig) -> InMemorySpanExporter:
    """Tracing on for `r`'s pipeline, every request sampled, its spans kept in memory."""
    base = setup("test", "heterogate-gateway", {"OTEL_TRACES_EXPORTER": "console"})
    assert base is not None
    exporter = InMemorySpanExporter()
    r.pipeline.tracing = Tracing(TraceSetup(base.tracer, base.sampler, base.resource, base.scope,
                                            (SimpleSpanProcessor(exporter),)))
    return exporter


def named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name.startswith(prefix)), key=lambda s: s.start_time or 0)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_retried_request_has_an_attempt_span_per_dispatch_the_failed_one_marked() -> None:
    r = rig({"a": "language", "b": "language", "c": "language"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": fails, "b": serves, "c": serves}
    exporter = traced(r)
    rec = record(r)
    rec.traceparent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
    await drain(await r.pipeline.start(job(), rec))
    RequestLog(r.pipeline.metrics, "round_robin").finish(rec, 200, prompt_tokens=12, completion_tokens=3)

    spans = exporter.get_finished_spans()
    (root,) = named(spans, "chat")
    assert root.context is not None and f"{root.context.trace_id:032x}" == CLIENT_TRACE
    assert parent_of(root) == 0xb7ad6b7169203331
    assert root.attributes is not None and root.attributes["gen_ai.usage.output_tokens"] == 3
    routes, attempts = named(spans, "route"), named(spans, "attempt")
    assert [s.attributes["heterogate.backend"] for s in routes if s.attributes] == rec.backends
    assert [s.name for s in attempts] == [f"attempt {b}" for b in rec.backends]
    assert all(parent_of(s) == root.context.span_id for s in routes + attempts)
    failed, served = attempts
    assert failed.status.status_code is StatusCode.ERROR and served.status.status_code is StatusCode.UNSET
    assert failed.attributes is not None and failed.attributes["error.type"] == "BackendFailure"
    assert served.context is not None
    assert [parent_of(s) for s in named(spans, "first_token") + named(spans, "stream")] == [served.context.span_id] * 2
    # each engine call carried its own attempt's span as the parent
    sent = [c.job.traceparent for c in r.fleet.calls]
    assert sent == [f"00-{CLIENT_TRACE}-{s.context.span_id:016x}-01" for s in attempts if s.context is not None]


async def test_a_re_encode_is_a_second_encode_span_under_the_attempt() -> None:
    r = rig({"lang": "language", "v1": "vision", "v2": "vision"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"lang": serves}
    r.fleet.encode_fails = {"v1"}
    exporter = traced(r)
    await drain(await r.pipeline.start(job(images=1), record(r)))
    spans = exporter.get_finished_spans()
    (attempt,) = named(spans, "attempt")
    encodes = named(spans, "encode")
    assert [s.name for s in encodes] == ["encode v1", "encode v2"]
    assert attempt.context is not None and all(parent_of(s) == attempt.context.span_id for s in encodes)
    assert [s.status.status_code for s in encodes] == [StatusCode.ERROR, StatusCode.UNSET]
    assert encodes[1].attributes is not None and encodes[1].attributes["heterogate.embedding_bytes"] == 1024


async def test_an_admission_wait_is_a_span_as_long_as_the_wait() -> None:
    r = rig({"a": "language"})
    r.fleet.scripts = {"a": serves}
    exporter = traced(r)
    depth = r.pipeline.admission.config.saturated_queue_depth

    def heartbeat(queue_depth: int) -> None:
        entry = r.table.get("a")
        assert entry is not None
        seq = entry.reported.seq + 1
        r.table.apply_heartbeat("a", seq, "fake://a", Reported(seq=seq, waiting=queue_depth,
                                                               kv_free_bytes=40 << 30, kv_total_bytes=40 << 30))

    heartbeat(depth)   # saturated: the request waits in the queue
    task = asyncio.create_task(r.pipeline.start(job(), record(r)))
    await until(lambda: r.pipeline.admission.waiting > 0)
    r.clock.advance(0.25)
    heartbeat(0)
    r.pipeline.admission.notify()
    await drain(await task)
    (admission,) = named(exporter.get_finished_spans(), "admission")
    assert admission.start_time is not None and admission.end_time is not None
    assert abs((admission.end_time - admission.start_time) / 1e9 - 0.25) < 0.05   # the test clock's wait
