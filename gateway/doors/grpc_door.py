"""The gRPC front door (Inference.Generate), with the gRPC health and reflection services.

Requests are turned into the same OpenAI request models as on the HTTP door (images as data URLs),
so validation, limits and routing are identical; errors become gRPC status codes with a message, and
a `retry-after` trailer (whole seconds) where the HTTP door would send `Retry-After`.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from common.grpc_decoding import lenient, register
from common.wire import control_pb2, inference_pb2, inference_pb2_grpc
from gateway.doors.client_errors import client_message, retry_after
from gateway.doors.jobs import JobBuilder
from gateway.doors.request_ids import new_request_id
from gateway.pipeline.request_log import RequestLog, RequestRecord
from gateway.requests.errors import InvalidRequest, RequestError, ShuttingDown, grpc_code_name
from gateway.requests.images import FORMATS
from gateway.requests.job import GenerationJob
from gateway.requests.openai_format import cached_tokens
from gateway.requests.openai_types import ChatCompletionRequest, CompletionRequest, body_error
from gateway.runtime import Runtime

_SNIFF = {b"\x89PNG": "PNG", b"\xff\xd8\xff": "JPEG", b"RIFF": "WEBP"}


def _data_url(data: bytes) -> str:
    fmt = next((f for magic, f in _SNIFF.items() if data.startswith(magic)), "PNG")
    return f"data:{FORMATS[fmt]};base64,{base64.b64encode(data).decode()}"


def _openai_body(request: inference_pb2.GenerateRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": request.model, "stream": True}   # Generate streams its replies
    if request.max_tokens:
        body["max_tokens"] = request.max_tokens
    if request.has_temperature:
        body["temperature"] = request.temperature
    if request.prompt and request.messages:
        raise InvalidRequest("send messages (a chat) or prompt (a completion), not both", param="prompt")
    if request.prompt:
        body["prompt"] = request.prompt
        return body
    if not request.messages:
        raise InvalidRequest("the request has no prompt and no messages: send messages (a chat) or a prompt "
                             "(a completion) that is not empty", param="prompt")
    messages = []
    for m in request.messages:
        if not m.images:
            messages.append({"role": m.role, "content": m.text})
            continue
        parts: list[dict[str, Any]] = [{"type": "text", "text": m.text}] if m.text else []
        parts += [{"type": "image_url", "image_url": {"url": _data_url(img)}} for img in m.images]
        messages.append({"role": m.role, "content": parts})
    body["messages"] = messages
    return body


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._jobs = JobBuilder(runtime)
        self._requests = RequestLog(runtime.metrics, runtime.pipeline.policy.name, runtime.pipeline.tenants,
                                   runtime.pipeline.tracing)
        self._calls: set[asyncio.Task[Any]] = set()   # the Generate calls under way
        self._cut: set[asyncio.Task[Any]] = set()     # those `drain` cancelled (not their clients)
        self._stopping: str | None = None             # set when the gateway stops: why calls are refused or cut
        self.health: health.aio.HealthServicer | None = None   # set NOT_SERVING when the drain starts

    async def drain(self, drain_s: float, cut_s: float = 1.0) -> None:
        """The gateway stops: new calls are refused, those under way finish for up to `drain_s`, then
        each left ends with UNAVAILABLE naming the shutdown (not a backend's failure), waited for at most
        `cut_s` more."""
        self._stopping = "the gateway is shutting down; retry"
        if self.health is not None:   # health checks say so at once: balancers stop sending here
            await self.health.enter_graceful_shutdown()
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=drain_s)
        self._stopping = "the gateway is shutting down and its drain time ran out"
        calls = list(self._calls)
        for task in calls:
            self._cut.add(task)
            task.cancel()
        if calls:
            await asyncio.wait(calls, timeout=cut_s)

    async def _job(
        self, request: inference_pb2.GenerateRequest, record: RequestRecord, context: grpc.aio.ServicerContext
    ) -> GenerationJob:
        keys = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if len(keys) > 1:   # as on the HTTP door: which one counts is not left to the reader
            raise InvalidRequest("two authorization metadata entries: send one")
        tenant = record.caller = self._runtime.keys.check(keys[0] if keys else None, admin=False)
        rid = record.request_id
        remaining = context.time_remaining()
        body = _openai_body(request)
        try:
            if "prompt" in body:
                return await self._jobs.completion(CompletionRequest.model_validate(body), body, rid, remaining,
                                                   tenant)
            return await self._jobs.chat(ChatCompletionRequest.model_validate(body), body, rid, remaining, tenant)
        except ValidationError as exc:
            raise body_error(exc) from None

    async def Generate(
        self, request: inference_pb2.GenerateRequest | None, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateReply]:
        """`request` None: bytes that are no GenerateRequest (`common.grpc_decoding`): INVALID_ARGUMENT."""
        # the client's id where it is a sane token, as `x-request-id` over HTTP (it goes into logs and replies)
        record = RequestRecord(new_request_id((request.request_id if request else "") or None), "grpc")
        metadata = dict(context.invocation_metadata() or ())
        record.traceparent, record.tracestate = metadata.get("traceparent"), metadata.get("tracestate")   # W3C
        status, error, usage = 499, None, None   # closed early: the client went away
        this = asyncio.current_task()
        assert this is not None
        self._calls.add(this)
        try:
            if self._stopping is not None:
                raise ShuttingDown(self._stopping)
            if request is None:
                raise InvalidRequest("the request is not a GenerateRequest message (heterogate.inference.v1)")
            job = await self._job(request, record, context)
            dispatch = await self._runtime.pipeline.start(job, record)
            first = True
            async for chunk in dispatch.rest():
                reply = inference_pb2.GenerateReply(text=chunk.text, finish_reason=chunk.finish_reason)
                if first:
                    reply.request_id, reply.backend = job.request_id, dispatch.backend_id
                    reply.vision_backend = dispatch.vision_backend_id or ""
                    first = False
                if chunk.finish_reason:
                    reply.prompt_tokens = chunk.usage.prompt_tokens
                    reply.completion_tokens = chunk.usage.completion_tokens
                    if (cached := cached_tokens(chunk.usage)) is not None:
                        reply.cached_tokens = cached
                    usage = chunk.usage
                yield reply
            status = 200
        except RequestError as exc:
            status, error = exc.status, exc.message
            wait_s = retry_after(exc)   # as the HTTP door's Retry-After: a rate limit's window end, an overload's
            await context.abort(getattr(grpc.StatusCode, grpc_code_name(exc)), client_message(exc),
                                (("retry-after", str(wait_s)),) if wait_s is not None else ())
        except asyncio.CancelledError:
            if this not in self._cut or this.uncancel() > 0:   # the client went away
                raise
            cut = ShuttingDown(self._stopping or "the gateway is shutting down")   # cut by `drain`
            status, error = cut.status, cut.message
            await context.abort(grpc.StatusCode.UNAVAILABLE, error)
        finally:
            self._calls.discard(this)
            self._cut.discard(this)
            self._requests.finish(record, status, error=error,
                                  prompt_tokens=usage.prompt_tokens if usage else 0,
                                  completion_tokens=usage.completion_tokens if usage else 0,
                                  cached_tokens=cached_tokens(usage) if usage else None)


async def add_front_door(server: grpc.aio.Server, runtime: Runtime) -> InferenceService:
    """Inference + health (overall and per service) + reflection on the gateway's gRPC server; returns
    the inference service (the daemon drains it when it stops)."""
    door = InferenceService(runtime)
    # As inference_pb2_grpc.add_InferenceServicer_to_server registers it, but with a decoder that hands
    # the servicer None for bytes that are no message: a 400's INVALID_ARGUMENT, not UNKNOWN and a traceback.
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        door.Generate, request_deserializer=lenient(inference_pb2.GenerateRequest),
        response_serializer=inference_pb2.GenerateReply.SerializeToString)}
    register(server, inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name, handlers)
    health_servicer = door.health = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    control = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name
    for name in ("", inference):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([inference, control, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return door
