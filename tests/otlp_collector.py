"""An OTLP/HTTP trace receiver on 127.0.0.1 for the tests: what the gateway and its engines export, decoded.

It takes `POST /v1/traces` (protobuf, gzip or not) as a collector does and keeps every span as a
`ReceivedSpan`, with its service's name from the resource.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str    # hex
    span_id: str     # hex
    parent_id: str   # hex; "" for a root
    kind: str
    attributes: dict[str, Any]
    events: tuple[str, ...]
    failed: bool


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class Collector:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        KINDS.get(s.kind, "unspecified"), {a.key: _value(a.value) for a in s.attributes},
                        tuple(e.name for e in s.events), s.status.code == 2)
                    with self._lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, found: Callable[[], Any], timeout_s: float = 20.0) -> Any:
        """`found()` once it is truthy (spans are exported in batches); TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = found()
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"spans not received within {timeout_s} s; received: {[s.name for s in self.spans]}")


@contextmanager
def otlp_collector() -> Iterator[tuple[Collector, str]]:
    """A running receiver and its endpoint (for OTEL_EXPORTER_OTLP_ENDPOINT), stopped when the block ends."""
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            collector.take(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
