"""The two routes that carry every generation, POST /v1/chat/completions and /v1/completions, as raw ASGI.

Why not FastAPI here: in front of a fast engine, FastAPI's routing, request objects, dependency
solving, telemetry hook and exception middleware were the largest single share of the gateway's CPU
per request after the upstream client (`benchmarks/front_door.py`, docs/FRONT_DOOR.md). These two
routes are served straight from the ASGI scope; every other route (models, health, readiness,
metrics, admin) stays on the FastAPI app that this one wraps. The contract is unchanged: OpenAI
bodies and error shapes, `x-request-id`, `x-request-timeout`, API keys, 499 when the client leaves.

A client that disconnects cancels its request: one watcher task per request waits on `receive()`
for `http.disconnect` and cancels the handler, which cancels the engine call with it.

Each request has a `RequestRecord` from its arrival: the pipeline fills in its deadline, attempts and
backends, and `RequestLog.finish` counts it and writes its one log line, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from gateway.errors import InvalidRequest, MethodNotAllowed, PayloadTooLarge, RequestError, openai_error_body
from gateway.generation_job import GenerationJob
from gateway.jobs import JobBuilder
from gateway.openai_format import DONE, ChunkWriter, Kind, completion_body, error_event, usage
from gateway.openai_types import ChatCompletionRequest, CompletionRequest
from gateway.pipeline import Dispatch
from gateway.request_log import RequestLog, RequestRecord
from gateway.runtime import Runtime

S = TypeVar("S", ChatCompletionRequest, CompletionRequest)
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Request ids need to be unique, not secret: 128 bits from a generator seeded once from the OS, not an
# os.urandom call (a syscall) per request as uuid4 makes.
_IDS = random.Random()
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]
# The `endpoint` label of the request counters, by path: the same on the success and the error paths.
ENDPOINTS: dict[str, tuple[str, Kind]] = {"/v1/chat/completions": ("chat", "chat"),
                                          "/v1/completions": ("completions", "text")}
_WANTED = frozenset({b"authorization", b"x-request-id", b"x-request-timeout", b"content-length"})


def new_request_id(given: str | None) -> str:
    """The client's `x-request-id` when it is a sane token, else a fresh one."""
    return given if given is not None and REQUEST_ID.match(given) else f"{_IDS.getrandbits(128):032x}"


def parse(model: type[S], raw: bytes) -> S:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.from_body(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}", param=where or None) from None


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


def json_message(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Message:
    return {"type": "http.response.start", "status": status,
            "headers": [_JSON, (b"content-length", b"%d" % len(body)), *headers]}


def error_headers(err: RequestError, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", request_id.encode())]
    if err.retry_after_s is not None:
        headers.append((b"retry-after", b"%d" % max(1, round(err.retry_after_s))))
    return headers


def backend_headers(dispatch: Dispatch) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", dispatch.request_id.encode()), (b"x-heterogate-backend", dispatch.backend_id.encode())]
    if dispatch.vision_backend_id is not None:
        headers.append((b"x-heterogate-vision-backend", dispatch.vision_backend_id.encode()))
    return headers


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class _DisconnectWatch:
    """Cancels `task` when the client disconnects; `stop()` before the last send (after it, uvicorn's
    `receive()` answers `http.disconnect` for a finished response too)."""

    def __init__(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self.gone = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        task.cancel()

    def stop(self) -> None:
        self._watcher.cancel()


class CompletionsDoor:
    def __init__(self, runtime: Runtime, fallback: ASGIApp) -> None:
        self._runtime = runtime
        self._fallback = fallback
        self._jobs = JobBuilder(runtime)
        self._model_name = self._jobs.model_name
        self._max_body = runtime.limits.max_body_bytes
        self._requests = RequestLog(runtime.metrics, runtime.pipeline.policy.name)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        route = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self._fallback(scope, receive, send)
            return
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _WANTED}
        rid = new_request_id(headers.get("x-request-id"))
        endpoint, kind = route
        record = RequestRecord(rid, endpoint)
        watch: _DisconnectWatch | None = None
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['method']} is not allowed on {scope['path']}; use POST")
            self._runtime.keys.check(headers.get("authorization"), admin=False)
            timeout_s = client_timeout(headers.get("x-request-timeout"))
            raw = await self._read_body(receive, headers.get("content-length"))
            job, stream, include_usage = await self._job(kind, raw, rid, timeout_s)
            task = asyncio.current_task()
            assert task is not None
            watch = _DisconnectWatch(receive, task)
            if stream:
                await self._stream(send, watch, kind, job, include_usage, record)
            else:
                await self._complete(send, watch, kind, job, record)
        except RequestError as exc:
            if watch is not None:
                watch.stop()
            self._requests.finish(record, exc.status, error=exc.message)
            body = orjson.dumps(openai_error_body(exc))
            await send(json_message(exc.status, body, error_headers(exc, rid)))
            await send({"type": "http.response.body", "body": body})
        except _ClientGone:
            self._requests.finish(record, 499)   # not an error of anyone's (nginx's 499); nobody reads a reply
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._requests.finish(record, 499)

    async def _read_body(self, receive: Receive, declared: str | None) -> bytes:
        limit = self._max_body
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _job(self, kind: Kind, raw: bytes, rid: str, timeout_s: float | None) -> tuple[GenerationJob, bool, bool]:
        req: ChatCompletionRequest | CompletionRequest
        if kind == "chat":
            req = parse(ChatCompletionRequest, raw)
            job = await self._jobs.chat(req, rid, timeout_s)
        else:
            req = parse(CompletionRequest, raw)
            job = self._jobs.completion(req, rid, timeout_s)
        return job, req.stream, bool(req.stream_options and req.stream_options.include_usage)

    async def _complete(self, send: Send, watch: _DisconnectWatch, kind: Kind, job: GenerationJob,
                        record: RequestRecord) -> None:
        dispatch, chunks = await self._runtime.pipeline.complete(job, record)
        watch.stop()
        last = chunks[-1]
        self._requests.finish(record, 200, prompt_tokens=last.usage.prompt_tokens,
                              completion_tokens=last.usage.completion_tokens)
        if len(chunks) == 1 and last.relay:   # an upstream's whole reply, already in the client's shape
            body = last.relay
        else:
            use = usage(last.usage.prompt_tokens, last.usage.completion_tokens)
            text = "".join(c.text for c in chunks)
            body = orjson.dumps(completion_body(kind, job.request_id, self._model_name, text, last.finish_reason, use))
        await send(json_message(200, body, backend_headers(dispatch)))
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Send, watch: _DisconnectWatch, kind: Kind, job: GenerationJob,
                      include_usage: bool, record: RequestRecord) -> None:
        dispatch = await self._runtime.pipeline.start(job, record)
        await send({"type": "http.response.start", "status": 200, "headers": [*_SSE, *backend_headers(dispatch)]})
        w = ChunkWriter(kind, job.request_id, self._model_name)
        status, error, last = 500, None, dispatch.first
        try:
            if kind == "chat" and not dispatch.first.relay:   # an upstream sends its own role event
                await send({"type": "http.response.body", "body": w.role(), "more_body": True})
            async for chunk in dispatch.rest():
                event = chunk.relay or w.token(chunk.text, chunk.finish_reason or None)
                await send({"type": "http.response.body", "body": event, "more_body": True})
                last = chunk
            tail = DONE
            if include_usage:
                tail = w.usage(usage(last.usage.prompt_tokens, last.usage.completion_tokens)) + DONE
            status = 200
        except RequestError as exc:   # after the first token the status is sent: the error goes in the stream
            status, error = exc.status, exc.message
            tail = error_event(exc) + DONE
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            status = 499   # mid-stream: the request log keeps its backend and latency
            return
        finally:
            self._requests.finish(record, status, prompt_tokens=last.usage.prompt_tokens,
                                  completion_tokens=last.usage.completion_tokens, error=error)
        watch.stop()
        await send({"type": "http.response.body", "body": tail})
