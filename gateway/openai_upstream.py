"""Client of an existing OpenAI-compatible engine (vLLM, SGLang, ...): `kind: openai` backends.

The client's validated body goes upstream as-is (model name swapped for the upstream's, streaming
forced on with usage) and the upstream SSE is read back as the same chunk stream the gRPC engines
give, so retries, breakers, metrics and both front doors work unchanged. httpx errors are mapped at
this boundary: connection errors, timeouts, 5xx and 429 are backend failures (retryable before the
first token); other 4xx are the client's fault and come back as 400 with the upstream's message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from gateway.errors import BackendFailure, BackendTimeout, InvalidRequest
from gateway.generation_job import GenerationJob
from gateway.wire import engine_pb2


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


class OpenAIUpstreamClient:
    accepts_embeddings = False   # the upstream encodes its own images

    def __init__(self, backend_id: str, base_url: str, http: httpx.AsyncClient, upstream_model: str | None) -> None:
        self.backend_id = backend_id
        self.address = base_url.rstrip("/")
        self._http = http
        self._model = upstream_model

    def _body(self, job: GenerationJob) -> dict[str, Any]:
        body = dict(job.body)
        if self._model:
            body["model"] = self._model
        body.update(stream=True, stream_options={"include_usage": True}, max_tokens=job.max_tokens)
        body.pop("max_completion_tokens", None)
        return body

    async def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        path = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
        timeout = httpx.Timeout(connect=min(5.0, timeout_s), read=first_token_timeout_s, write=10.0, pool=5.0)
        started = False
        try:
            request = self._http.build_request(
                "POST", self.address + path, content=orjson.dumps(self._body(job)), timeout=timeout,
                headers={"content-type": "application/json", "x-request-id": job.request_id},
            )
            resp = await self._http.send(request, stream=True)
            try:
                if resp.status_code != 200:
                    message = _error_message(await resp.aread())
                    if resp.status_code >= 500 or resp.status_code == 429:
                        raise BackendFailure(f"backend {self.backend_id}: HTTP {resp.status_code}: {message}",
                                             backend_id=self.backend_id)
                    raise InvalidRequest(f"upstream rejected the request: {message}")
                async for chunk in self._chunks(resp):
                    started = True
                    yield chunk
            finally:
                await resp.aclose()
        except httpx.TimeoutException as exc:
            raise BackendTimeout(f"backend {self.backend_id}: {type(exc).__name__}", backend_id=self.backend_id,
                                 retryable=not started) from None
        except httpx.HTTPError as exc:
            raise BackendFailure(f"backend {self.backend_id}: {type(exc).__name__}: {exc}",
                                 backend_id=self.backend_id, retryable=not started) from None

    async def _chunks(self, resp: httpx.Response) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """SSE → chunks; the chunk with the finish reason is held back until usage arrives."""
        index, held = 0, None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = orjson.loads(data)
            if "error" in event:
                raise BackendFailure(f"backend {self.backend_id}: {event['error'].get('message', 'error')}",
                                     backend_id=self.backend_id, retryable=index == 0)
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                chunk = engine_pb2.GenerateChunk(text=text, index=index)
                index += 1
                if choice.get("finish_reason"):
                    chunk.finish_reason = choice["finish_reason"]
                    held = chunk
                else:
                    yield chunk
            if event.get("usage") and held is not None:
                held.usage.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                held.usage.completion_tokens = event["usage"].get("completion_tokens", 0)
        if held is None:
            raise BackendFailure(f"backend {self.backend_id}: stream ended without a finish reason",
                                 backend_id=self.backend_id, retryable=index == 0)
        if not held.usage.completion_tokens:
            held.usage.completion_tokens = index
        yield held

    async def close(self) -> None:
        """The shared httpx client is closed by the pool."""
