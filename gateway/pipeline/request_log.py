"""One JSON line per inference request, and the request counters, written in one place.

A `RequestRecord` is opened by a front door when a request arrives and filled by the pipeline (its
deadline, every dispatch attempt and the backends tried, the tokens handed to the door so far);
`RequestLog.finish` closes it exactly once, whatever the outcome (served, refused with a 4xx, failed
with a 5xx, or abandoned by the client):

    {"event": "request", "request_id": ..., "endpoint": "chat", "status": 200, "attempts": 2,
     "backends": ["a100-0", "h100-1"], "vision_backend": null, "latency_s": 0.84, "ttft_s": 0.12,
     "prompt_tokens": 31, "completion_tokens": 64, ...}

The token counts are the engine's final usage when the door has it; a request that ends before its
last chunk (a client that leaves mid-stream, a deadline or a backend failure after tokens flowed)
logs what the pipeline counted: its prompt tokens and the chunks handed out (one token each).

The hot path pays for one small object, a few appends, three counter increments (plain tables,
`gateway.pipeline.request_metrics`) and one log call; the line is rendered by the logging set-up of
`common.logs` (orjson). `benchmarks/request_log_cost.py` measures it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import structlog

from gateway.pipeline.metrics import GatewayMetrics
from gateway.pipeline.tenants import Tenants, Ticket
from gateway.pipeline.tracing import RequestTrace, Tracing
from gateway.routing.prefix_index import PrefixQuery

log = structlog.get_logger("http")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None        # monotonic; set by the pipeline from the client's timeout
    attempts: int = 0                    # language dispatch attempts, restarts included
    backends: list[str] = field(default_factory=list)          # in attempt order
    vision_backends: list[str] = field(default_factory=list)   # encode attempts, in order
    failed: list[str] = field(default_factory=list)   # backends that failed it: not tried again for it
    policy: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0               # of the dispatch that got a first token (text + image tokens)
    completion_tokens: int = 0           # chunks of that dispatch handed to the door so far
    finished: bool = False
    prefix: PrefixQuery | None = None    # the prefix index's view of its prompt (cache-aware routing)
    tenant: Ticket | None = None         # its tenant's charges (from admission), settled with its usage at the end
    # Whose key sent it, from the door's key check: a request refused before admission (a 400, a 404) has no
    # ticket, and its log line names its tenant all the same.
    caller: str | None = None
    closed: tuple[str, ...] = ()         # backends kept for priority classes above its tenant's: never its candidates
    unable: tuple[str, ...] = ()         # engines that cannot honour its fields, beside upstreams that can
    no_encoder: tuple[str, ...] = ()     # backends that need an encoder, after none could encode its images
    model: str = ""                      # the model it asked for (its served name), once validated
    traceparent: str | None = None       # the client's W3C trace context header, if it sent one
    tracestate: str | None = None        # and its vendors' state, passed on as sent
    trace: RequestTrace | None = None    # tracing on: its spans, or unsampled its trace id only

    def attempt(self, backend_id: str) -> None:
        self.attempts += 1
        self.backends.append(backend_id)


class RequestLog:
    def __init__(self, metrics: GatewayMetrics, default_policy: str, tenants: Tenants | None = None,
                 tracing: Tracing | None = None) -> None:
        self._metrics = metrics
        self._policy = default_policy
        self._tenants = tenants   # counts the requests refused before their tenant's ticket
        self._tracing = tracing   # tracing on: a span for each request refused before the pipeline
        # The line's level is on (set by common.logs.configure_logging before the doors are built):
        # with it off, the line's fields are not even gathered.
        self._lines = logging.getLogger().isEnabledFor(logging.INFO)

    def finish(
        self, record: RequestRecord, status: int, *, prompt_tokens: int = 0, completion_tokens: int = 0,
        cached_tokens: int | None = None, error: str | None = None,
    ) -> None:
        """Count and log the request once; later calls for the same record are no-ops. Token counts
        left at 0 (no final usage came) are the record's. `cached_tokens`: of the prompt, those the
        engine found in its prefix cache (None: it did not say), logged beside the prefix index's
        prediction for that backend."""
        if record.finished:
            return
        record.finished = True
        prompt_tokens = prompt_tokens or record.prompt_tokens
        completion_tokens = completion_tokens or record.completion_tokens
        m = self._metrics
        backend = m.live(record.backends[-1]) if record.backends else "none"
        policy = record.policy or self._policy
        m.requests.inc((record.endpoint, record.model, policy, backend, str(status)))
        if prompt_tokens or completion_tokens:
            m.prompt_tokens.inc((backend,), prompt_tokens)
            m.generation_tokens.inc((backend,), completion_tokens)
        if record.tenant is not None:
            record.tenant.finish(status, prompt_tokens, completion_tokens)
        elif record.caller is not None and self._tenants is not None:
            self._tenants.refused_before_ticket(record.caller, status)
        if record.trace is None and self._tracing is not None:   # refused before the pipeline traced it
            record.trace = self._tracing.refused(record.endpoint, record.model, record.request_id, record.traceparent,
                                                 time.monotonic() - record.started)
        if record.trace is not None:
            record.trace.end(status, prompt_tokens, completion_tokens, error)
        if not self._lines:
            return
        log.info(
            "request", request_id=record.request_id, endpoint=record.endpoint, status=status,
            attempts=record.attempts, backends=record.backends,
            vision_backends=record.vision_backends, policy=policy,
            latency_s=round(time.monotonic() - record.started, 4),
            ttft_s=None if record.ttft_s is None else round(record.ttft_s, 4),
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
            predicted_cached_tokens=record.prefix.cached.get(record.backends[-1], 0)
            if record.prefix is not None and record.backends else None, error=error,
            tenant=record.tenant.name if record.tenant is not None else record.caller, model=record.model or None,
        )
