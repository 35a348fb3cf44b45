"""The OpenAI-compatible HTTP front door (FastAPI).

Bodies are read with a size cap and parsed by `openai_types`; every error leaves through
`error_response`, so clients always get an OpenAI-shaped body, never a stack trace.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import (
    InvalidRequest,
    PayloadTooLarge,
    RequestError,
    openai_error_body,
)
from gateway.generation_job import GenerationJob
from gateway.jobs import JobBuilder
from gateway.openai_format import DONE, ChunkWriter, Kind, completion_body, error_event, usage
from gateway.openai_types import ChatCompletionRequest, CompletionRequest
from gateway.pipeline import Dispatch
from gateway.runtime import Runtime

log = structlog.get_logger("http")
T = TypeVar("T")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class ClientDisconnected(Exception):
    pass


# The `endpoint` label of the request counters: the same name on the success and the error paths.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def endpoint_of(request: Request) -> str:
    return ENDPOINTS.get(request.url.path, request.url.path)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(err: RequestError, request_id: str) -> Response:
    headers = {"x-request-id": request_id}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after_s)))
    return json_response(openai_error_body(err), err.status, headers)


def request_id_of(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        request.state.request_id = rid
    return str(rid)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse(model: type[T], raw: bytes) -> T:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)  # type: ignore[attr-defined, no-any-return]
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}", param=where or None) from None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (the engine RPC is cancelled with it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientDisconnected
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(runtime: Runtime) -> FastAPI:
    app = FastAPI(title="HeteroGate", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    limits = runtime.limits
    jobs = JobBuilder(runtime)
    model_name = jobs.model_name

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
        """Not an error of anyone's: counted (as nginx's 499) and logged quietly; nobody reads the reply."""
        runtime.metrics.requests.labels(endpoint_of(request), runtime.pipeline.policy.name, "none", "499").inc()
        log.info("client_disconnected", request_id=request_id_of(request))
        return Response(status_code=499)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        backend = getattr(exc, "backend_id", "none")
        runtime.metrics.requests.labels(endpoint_of(request), runtime.pipeline.policy.name, backend,
                                        str(exc.status)).inc()
        return error_response(exc, request_id_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = RequestError(str(exc.detail))
        err.status, err.type = exc.status_code, "invalid_request_error"
        return error_response(err, request_id_of(request))

    async def serve(
        request: Request, kind: Kind, job: GenerationJob, stream: bool, include_usage: bool, endpoint: str
    ) -> Response:
        rid = job.request_id
        if stream:
            dispatch = await unless_disconnected(request, runtime.pipeline.start(job))
            events = sse(dispatch, ChunkWriter(kind, rid, model_name), include_usage, endpoint)
            headers = {**backend_headers(dispatch), **_SSE_HEADERS}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        dispatch, chunks = await unless_disconnected(request, runtime.pipeline.complete(job))
        done(dispatch, endpoint, "ok")
        last = chunks[-1]
        if len(chunks) == 1 and last.relay:   # an upstream's whole reply, already in the client's shape
            return Response(last.relay, media_type="application/json", headers=backend_headers(dispatch))
        use = usage(last.usage.prompt_tokens, last.usage.completion_tokens)
        body = completion_body(kind, rid, model_name, "".join(c.text for c in chunks), last.finish_reason, use)
        return json_response(body, headers=backend_headers(dispatch))

    def backend_headers(dispatch: Dispatch) -> dict[str, str]:
        headers = {"x-request-id": dispatch.request_id, "x-heterogate-backend": dispatch.backend_id}
        if dispatch.vision_backend_id is not None:
            headers["x-heterogate-vision-backend"] = dispatch.vision_backend_id
        return headers

    async def sse(dispatch: Dispatch, w: ChunkWriter, include_usage: bool, endpoint: str) -> AsyncIterator[bytes]:
        status = "error"
        try:
            if w.kind == "chat" and not dispatch.first.relay:   # an upstream sends its own role event
                yield w.role()
            async for chunk in dispatch.rest():
                yield chunk.relay or w.token(chunk.text, chunk.finish_reason or None)
                last = chunk
            if include_usage:
                yield w.usage(usage(last.usage.prompt_tokens, last.usage.completion_tokens))
            status = "ok"
        except RequestError as exc:
            yield error_event(exc)
        finally:
            done(dispatch, endpoint, status)
        yield DONE

    def done(dispatch: Dispatch, endpoint: str, status: str) -> None:
        policy = dispatch.decision.policy
        runtime.metrics.requests.labels(endpoint, policy, dispatch.backend_id, status).inc()
        log.info("request", request_id=dispatch.request_id, policy=policy,
                 backend=dispatch.backend_id, cost=round(dispatch.decision.cost, 6),
                 ttft_s=round(dispatch.ttft_s, 4), latency_s=round(time.monotonic() - dispatch.started, 4),
                 status=status, endpoint=endpoint)

    def client_timeout(request: Request) -> float | None:
        raw = request.headers.get("x-request-timeout")
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise InvalidRequest("x-request-timeout must be a positive number of seconds", param="x-request-timeout")
        return value

    def authorize(request: Request, *, admin: bool = False) -> None:
        runtime.keys.check(request.headers.get("authorization"), admin=admin)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        rid = request_id_of(request)
        authorize(request)
        req = parse(ChatCompletionRequest, await read_body(request, limits.max_body_bytes))
        job = await jobs.chat(req, rid, client_timeout(request))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await serve(request, "chat", job, req.stream, include_usage, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        rid = request_id_of(request)
        authorize(request)
        req = parse(CompletionRequest, await read_body(request, limits.max_body_bytes))
        job = jobs.completion(req, rid, client_timeout(request))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await serve(request, "text", job, req.stream, include_usage, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        item = {"id": model_name, "object": "model", "created": 0, "owned_by": "heterogate",
                "max_model_len": runtime.table.largest_context()}   # as vLLM lists it: the longest any backend serves
        return json_response({"object": "list", "data": [item]})

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        healthy = runtime.healthy_language_backends()
        status = 200 if healthy else 503
        return json_response({"ready": bool(healthy), "healthy_language_backends": healthy}, status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request, admin=True)
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/backends")
    async def admin_backends(request: Request) -> Response:
        authorize(request, admin=True)
        return json_response({"object": "list", "data": runtime.describe_backends()})

    return app
