"""The two routes that carry every generation, POST /v1/chat/completions and /v1/completions.

Why handlers of the server itself and not routes of a framework: in front of a fast engine, FastAPI's
routing, request objects, dependency solving and exception middleware were the largest single share
of the gateway's CPU per request after the upstream client (docs/FRONT_DOOR.md). These two routes
are handlers of the front door's own HTTP server (`gateway.doors.http_server`): they get the parsed
request and write their response straight to the connection, past the route table that serves the
other routes (`gateway.doors.route_table`). The contract: OpenAI bodies and error shapes,
`x-request-id`, `x-request-timeout`, API keys, 405 with `allow: POST` for another method, 499 when
the client leaves.

A client that disconnects cancels its request: the server cancels the handler's task when the
connection is lost (`Exchange.gone`), which cancels the engine call with it.

Each request has a `RequestRecord` from its arrival: the pipeline fills in its deadline, attempts and
backends, and `RequestLog.finish` counts it and writes its one log line, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import Any, TypeVar

import orjson
import structlog
from pydantic import ValidationError

from gateway.doors.client_errors import client_view, error_headers, error_json
from gateway.doors.http_server import Exchange, Handler, Request
from gateway.doors.jobs import JobBuilder
from gateway.doors.request_ids import new_request_id
from gateway.pipeline.dispatch import Dispatch
from gateway.pipeline.request_log import RequestLog, RequestRecord
from gateway.requests.errors import (
    InvalidRequest,
    MethodNotAllowed,
    RequestError,
    ShuttingDown,
    UnsupportedMediaType,
)
from gateway.requests.job import GenerationJob
from gateway.requests.openai_format import (
    DONE,
    ChunkWriter,
    Kind,
    cached_tokens,
    completion_body,
    error_event,
    usage_of,
)
from gateway.requests.openai_types import ChatCompletionRequest, CompletionRequest, body_error
from gateway.runtime import Runtime

S = TypeVar("S", ChatCompletionRequest, CompletionRequest)

log = structlog.get_logger("gateway.http")

_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]
# The `endpoint` label of the request counters, by path: the same on the success and the error paths.
ENDPOINTS: dict[str, tuple[str, Kind]] = {"/v1/chat/completions": ("chat", "chat"),
                                          "/v1/completions": ("completions", "text")}
_ALLOW = [(b"allow", b"POST")]
_WANTED = frozenset({b"authorization", b"x-request-id", b"x-request-timeout", b"x-session-id", b"traceparent",
                     b"tracestate", b"content-encoding"})


def parse(model: type[S], raw: bytes) -> tuple[S, dict[str, Any]]:
    """The request validated by `model`, and the client's body as sent (for upstreams that take it)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        why = "it is not UTF-8 text" if "UTF-8" in str(exc) else str(exc)   # orjson: "...surrogates not allowed"
        raise InvalidRequest(f"request body is not valid JSON: {why}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data), data
    except ValidationError as exc:
        raise body_error(exc) from None


def client_timeout(raw: str | None) -> float | None:
    """The client's `x-request-timeout` in seconds (the server maximum still caps it)."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InvalidRequest("x-request-timeout must be a positive number of seconds", param="x-request-timeout")
    return value


def backend_headers(dispatch: Dispatch) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", dispatch.request_id.encode()), (b"x-heterogate-backend", dispatch.backend_id.encode())]
    if dispatch.vision_backend_id is not None:
        headers.append((b"x-heterogate-vision-backend", dispatch.vision_backend_id.encode()))
    return headers


class CompletionsDoor:
    """The handlers of the two completion routes, for `gateway.doors.http_server.HttpServer`."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._jobs = JobBuilder(runtime)
        self._model_name = self._jobs.model_name
        self._requests = RequestLog(runtime.metrics, runtime.pipeline.policy.name, runtime.pipeline.tenants,
                                   runtime.pipeline.tracing)

    def refused_while_read(self, path: bytes, status: int, request_id: str, message: str) -> None:
        """A completion request the server refused before its handler (a body over the limit or too slow,
        headers too large): counted and logged as every request is. Other paths' refusals: a log line."""
        served = ENDPOINTS.get(path.decode("latin-1"))
        if served is None:
            log.warning("http_request_refused", path=path.decode("latin-1")[:256], status=status,
                        request_id=request_id, error=message)
            return
        self._requests.finish(RequestRecord(request_id, served[0]), status, error=message)

    def routes(self) -> dict[str, Handler]:
        # partial, not a wrapping coroutine: one frame fewer to pass through on every resume
        return {path: functools.partial(self._serve, path=path, endpoint=endpoint, kind=kind)
                for path, (endpoint, kind) in ENDPOINTS.items()}

    async def _serve(self, request: Request, exchange: Exchange, *, path: str, endpoint: str, kind: Kind) -> None:
        headers = {k.decode(): v.decode("latin-1") for k, v in request.headers if k in _WANTED}
        rid = new_request_id(headers.get("x-request-id"))
        record = RequestRecord(rid, endpoint, traceparent=headers.get("traceparent"),   # W3C trace context
                               tracestate=headers.get("tracestate"))
        try:
            if request.method != "POST":
                raise MethodNotAllowed(f"{request.method} is not allowed on {path}; use POST")
            tenant = record.caller = self._runtime.keys.check(headers.get("authorization"), admin=False)
            encoding = headers.get("content-encoding")   # mostly absent: nothing more to do
            if encoding is not None and (encoding := encoding.strip().lower()) != "identity":
                # a gzip body read as JSON was "str is not valid UTF-8: surrogates not allowed"
                raise UnsupportedMediaType(f"content-encoding {encoding!r} is not supported: send the body "
                                           "uncompressed", param="content-encoding")
            timeout_s = client_timeout(headers.get("x-request-timeout"))
            job, stream, include_usage = await self._job(kind, request.body, rid, timeout_s, tenant)
            session = headers.get("x-session-id")   # names the conversation, over the body's `user`
            if session:
                job = replace(job, session=session)
            if stream:
                await self._stream(exchange, kind, job, include_usage, record)
            else:
                await self._complete(exchange, kind, job, record)
        except RequestError as exc:   # the client gets the gateway's words; the log line, the whole error
            allow = _ALLOW if isinstance(exc, MethodNotAllowed) else []
            exchange.respond(exc.status, error_headers(exc, rid) + allow, error_json(exc))
            self._requests.finish(record, exc.status, error=exc.message)
        except asyncio.CancelledError:
            if exchange.cut and not exchange.started and not exchange.gone:   # the gateway stops: the client is told
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                cut = ShuttingDown("the gateway is shutting down and its drain time ran out; retry")
                exchange.respond(cut.status, error_headers(cut, rid), error_json(cut))
                self._requests.finish(record, cut.status, error=cut.message)
                return
            if not exchange.gone:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._requests.finish(record, 499)   # not an error of anyone's (nginx's 499); nobody reads a reply

    async def _job(self, kind: Kind, raw: bytes, rid: str, timeout_s: float | None, tenant: str) -> (
        tuple[GenerationJob, bool, bool]
    ):
        req: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            req, body = parse(ChatCompletionRequest, raw)
            job = await self._jobs.chat(req, body, rid, timeout_s, tenant)
        else:
            req, body = parse(CompletionRequest, raw)
            job = await self._jobs.completion(req, body, rid, timeout_s, tenant)
        return job, bool(req.stream), bool(req.stream_options and req.stream_options.include_usage)

    async def _complete(self, exchange: Exchange, kind: Kind, job: GenerationJob, record: RequestRecord) -> None:
        dispatch, chunks = await self._runtime.pipeline.complete(job, record)
        last = chunks[-1]
        if len(chunks) == 1 and last.relay:   # an upstream's whole reply, already in the client's shape
            body = last.relay
        else:
            use = usage_of(last.usage)
            text = "".join(c.text for c in chunks)
            body = orjson.dumps(completion_body(kind, job.request_id, job.model or self._model_name, text,
                                                last.finish_reason, use))
        exchange.respond(200, backend_headers(dispatch), body)   # the client first, the log line after
        self._requests.finish(record, 200, prompt_tokens=last.usage.prompt_tokens,
                              completion_tokens=last.usage.completion_tokens, cached_tokens=cached_tokens(last.usage))

    async def _stream(self, exchange: Exchange, kind: Kind, job: GenerationJob, include_usage: bool,
                      record: RequestRecord) -> None:
        dispatch = await self._runtime.pipeline.start(job, record)
        exchange.start_stream(200, [*_SSE, *backend_headers(dispatch)])
        w = ChunkWriter(kind, job.request_id, job.model or self._model_name)
        status, error, last = 500, None, dispatch.first
        tail: bytes | None = None   # the stream's end, when it ends with one
        try:
            if kind == "chat" and not dispatch.first.relay:   # an upstream sends its own role event
                exchange.send(w.role())
            async for chunk in dispatch.rest():
                exchange.send(chunk.relay or w.token(chunk.text, chunk.finish_reason or None))
                await exchange.drain()
                last = chunk
            tail = DONE
            if include_usage:
                tail = w.usage(usage_of(last.usage)) + DONE
            status = 200
        except RequestError as exc:   # after the first token the status is sent: the error goes in the stream
            status, error = exc.status, exc.message
            tail = error_event(client_view(exc)) + DONE
        except asyncio.CancelledError:
            if exchange.cut and not exchange.gone:   # the gateway stops: the stream ends with the reason
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                cut = ShuttingDown("the gateway is shutting down and its drain time ran out")
                status, error, tail = cut.status, cut.message, error_event(cut) + DONE
            else:
                if not exchange.gone:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                status = 499   # mid-stream: the request log keeps its backend and latency
        finally:
            if tail is not None:   # the client first, the log line after
                exchange.end_stream(tail)
            self._requests.finish(record, status, prompt_tokens=last.usage.prompt_tokens,
                                  completion_tokens=last.usage.completion_tokens,
                                  cached_tokens=cached_tokens(last.usage), error=error)
