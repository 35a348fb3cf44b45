"""Client of an existing OpenAI-compatible engine (vLLM, SGLang, ...): `kind: openai` backends.

The client's body goes upstream with every field it sent (tools, tool_choice, tool_calls and
tool_call_id in messages, response_format, logprobs, seed, n, penalties, logit_bias, vendor fields
such as top_k or chat_template_kwargs); the gateway changes only what it must: the model name (to
the upstream's), `stream`, `max_tokens` (the gateway's bound; `max_completion_tokens` folded in),
`stream_options.include_usage` (the gateway counts tokens) and, with `image_embeds`, image parts
replaced by their embeddings. An `api_key` of the backend goes as `Authorization: Bearer`. A streamed
request is read back from the upstream SSE as the same chunk stream the gRPC engines give; a
non-streamed one is asked of the upstream non-streamed and its reply comes back whole, as one chunk
whose `relay` is the upstream's JSON body with the gateway's id and model (tool_calls, logprobs and
every other field kept; one parse instead of one per token). Either way retries, breakers, metrics
and both front doors work unchanged. Transport errors are mapped at this boundary: connection errors,
timeouts, 5xx, 429, 401/403 (the backend's api_key), 404 (a model it does not serve) and 408 are backend
failures (retryable before the first token; a 429, or a 503 that says when to come back, that is the
last reaches the client as such, with its Retry-After); other 4xx are the client's fault and come back
as 400 with the upstream's message.

With `image_embeds: true` the backend is the language side of the modality split: the pipeline has a
vision backend encode the images first and passes the embeddings in, which go upstream as vLLM
`image_embeds` content parts (see `gateway.clients.image_embeds`). The overall request deadline bounds every
read, not only the first.

The HTTP client is `gateway.clients.upstream_http`, one keep-alive pool per backend: httpx's pool cost about
half of the gateway's CPU per request in front of a fast engine, aiohttp's request path 87 µs, the
lean httptools client 18 µs (see that module).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from common.catalog import ModelProfile
from common.wire import engine_pb2
from gateway.clients.image_embeds import with_image_embeds
from gateway.clients.upstream_http import UpstreamPool, UpstreamResponse
from gateway.requests.errors import BackendFailure, BackendTimeout, InvalidRequest, RequestError
from gateway.requests.job import GenerationJob, Handoff
from gateway.requests.openai_format import completion_id

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Upstream:
    """How to talk to one kind: openai backend."""

    model: str | None = None                  # the model name it serves under (default: the client's)
    embeds_model: ModelProfile | None = None  # it takes this model's image embeddings inline
    api_key: str | None = None                # sent as Authorization: Bearer


def _error_message(body: bytes) -> str:
    """The message of an upstream's error body, in each shape the engines write one: OpenAI's and current
    vLLM's `{"error": {"message"}}`, SGLang's and older vLLM's `{"object": "error", "message"}`, vLLM's
    `--api-key` refusal `{"error": "Unauthorized"}`, a FastAPI server's own `{"detail": ...}` (a string,
    or its 422 validation errors, each as `loc: msg`); else the body's start as it came."""
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        reply = None
    if isinstance(reply, dict):
        error = reply.get("error")
        if isinstance(error, dict):
            error = error.get("message")
        message = error or reply.get("message") or _detail(reply.get("detail"))
        if isinstance(message, str):
            return message
        if not reply:   # `{}`: it said nothing
            return ""
    return body[:200].decode(errors="replace")


def _detail(detail: object) -> str | None:
    """FastAPI's `detail`: its message, or its validation errors as `loc: msg; ...` (None: neither)."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = [".".join(str(at) for at in d.get("loc") or ()) + f": {d['msg']}" for d in detail
                 if isinstance(d, dict) and isinstance(d.get("msg"), str)]
        return "; ".join(parts) or None
    return None


def _retry_after_s(headers: list[tuple[bytes, bytes]]) -> float | None:
    """An upstream reply's `Retry-After` in seconds (its delay-seconds form; None: an HTTP date or none)."""
    for name, value in headers:
        if name == b"retry-after":
            try:
                return float(max(0, int(value)))   # delay-seconds: digits only (no "inf", no fraction)
            except ValueError:
                break
    return None


class UpstreamRateLimited(BackendFailure):
    """An upstream's 429. Retried elsewhere like any backend failure; when it is the request's last, the
    client gets a 429 with the upstream's Retry-After, not a 502: the engine is busy, not broken, and
    OpenAI's SDKs wait that long before they try again."""

    status = 429
    type = "rate_limit_error"
    code = "upstream_rate_limited"

    doing = "is rate limiting requests"   # what the client is told the backend does

    def __init__(self, message: str, *, backend_id: str, retry_after_s: float, said: str = "") -> None:
        super().__init__(message, backend_id=backend_id)
        self.retry_after_s = retry_after_s
        self.said = said   # the upstream's own message (written for its clients), "" where it gave none


class UpstreamUnavailable(UpstreamRateLimited):
    """An upstream's 503 with a Retry-After: overloaded or not ready, and it says when to come back (an
    engine's own load shedding, or a load balancer in front of engines). Handled as a 429: retried
    elsewhere, no fault of the backend, and when it is the request's last the client gets the 503 with
    that Retry-After, not a 502. A 503 without one stays a backend failure (a proxy with nothing
    behind it says so every time)."""

    status = 503
    type = "service_unavailable"
    code = "upstream_unavailable"
    doing = "is unavailable for now"


class _Relay:
    """An upstream reply or SSE event as the client will see it: the gateway's completion id and model name.

    The two values are swapped in the bytes (compact JSON, as vLLM and SGLang write it); only a body
    written some other way is re-encoded. Everything else the upstream sent passes through untouched,
    byte for byte. An upstream's id and model are the same in every event of a stream, so their bytes
    are worked out once and checked for in each event.
    """

    def __init__(self, completion_id: str, served_model: str) -> None:
        self._id = b'"id":' + orjson.dumps(completion_id)
        self._model = b'"model":' + orjson.dumps(served_model) if served_model else b""
        self._served = (completion_id, served_model)
        self._seen: tuple[Any, Any] | None = None
        self._swaps: list[tuple[bytes, bytes]] = []

    def swapped(self, raw: bytes, parsed: dict[str, Any]) -> bytes:
        """`raw` (whose JSON is `parsed`) with the gateway's id and model."""
        if not self._has_swaps(raw):   # the first body, or one whose id or model differs from the last's
            seen = (parsed.get("id"), parsed.get("model"))
            if seen != self._seen:
                self._seen = seen
                self._swaps = [(b'"id":' + orjson.dumps(seen[0]), self._id)]
                if self._model:
                    self._swaps.append((b'"model":' + orjson.dumps(seen[1]), self._model))
            if not self._has_swaps(raw):   # not compact JSON: re-encoded
                served_id, served_model = self._served
                return orjson.dumps({**parsed, "id": served_id, **({"model": served_model} if self._model else {})})
        for old, new in self._swaps:
            raw = raw.replace(old, new, 1)
        return raw

    def _has_swaps(self, raw: bytes) -> bool:
        if not self._swaps:
            return False
        for old, _ in self._swaps:
            if old not in raw:
                return False
        return True

    def event(self, raw: bytes, event: dict[str, Any]) -> bytes:
        """An SSE payload as the client's `data:` event."""
        return b"data: " + self.swapped(raw, event) + b"\n\n"


class OpenAIUpstreamClient:
    def __init__(self, backend_id: str, base_url: str, pool: UpstreamPool, upstream: Upstream) -> None:
        self.backend_id = backend_id
        self.address = base_url.rstrip("/")
        self._pool = pool
        self._model = upstream.model
        self._embeds_model = upstream.embeds_model
        self._headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
        if upstream.api_key:
            self._headers += (("authorization", f"Bearer {upstream.api_key}"),)
        # inline: takes embeddings in the request body; none: the upstream encodes its own images
        self.handoff: Handoff = "inline" if upstream.embeds_model is not None else "none"

    def _body(self, job: GenerationJob, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The upstream's request body: the client's (or `body`, the client's with its images' embeddings)
        with the upstream's model, stream and max_tokens."""
        body = dict(job.body) if body is None else body
        if self._renamed(job):
            body["model"] = self._model or job.model
        body.update(stream=not job.whole, max_tokens=job.max_tokens)
        options = body.pop("stream_options", None)
        if not job.whole:
            options = dict(options) if isinstance(options, dict) else {}
            if options.get("continuous_usage_stats") and not options.get("include_usage"):
                options["continuous_usage_stats"] = False   # usage in every chunk only where the client asked for it
            body["stream_options"] = {**options, "include_usage": True}
        body.pop("max_completion_tokens", None)
        if job.cache_salt and body.get("cache_salt") != job.cache_salt:   # the tenant's (tenants.isolate_prefix_cache)
            body["cache_salt"] = job.cache_salt
        return body

    def _renamed(self, job: GenerationJob) -> bool:
        """Whether the upstream knows the model by another name than the client sent: its `upstream_model`,
        or the model's own name where the client used an alias (the reply names the client's again)."""
        sent = self._model or job.model
        return bool(sent) and sent != job.body.get("model")

    def _reply_model(self, job: GenerationJob) -> str:
        """The model name the client's reply carries where the upstream's differs ("": as it came)."""
        return (job.model or job.body.get("model", "")) if self._renamed(job) else ""

    async def _body_with_embeds(self, job: GenerationJob) -> dict[str, Any]:
        """`_body` for an upstream that takes the images' embeddings in its request (built off the loop)."""
        assert self._embeds_model is not None
        body = await asyncio.to_thread(with_image_embeds, dict(job.body), self._embeds_model, job.images,
                                       job.embeddings)
        return self._body(job, body)

    def _inline_embeds(self, job: GenerationJob) -> bool:
        return bool(job.embeddings) and self._embeds_model is not None

    def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """The job's chunks: a non-streamed job's one chunk from one exchange, a streamed job's from
        the upstream's events as they come."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        if job.whole:
            return _OneChunk(self._exchange(job, deadline, timeout_s))
        return self._stream(job, deadline, first_token_timeout_s, timeout_s)

    async def _exchange(self, job: GenerationJob, deadline: float, timeout_s: float) -> engine_pb2.GenerateChunk:
        """A non-streamed request: asked non-streamed, its reply read whole. A reply arrives only after
        its last token, so only the request's deadline bounds it (the connection's timer, one for the
        whole exchange)."""
        try:
            payload = await self._body_with_embeds(job) if self._inline_embeds(job) else self._body(job)
            resp = await self._pool.post(_path(job), orjson.dumps(payload), self._request_headers(job),
                                         connect_timeout_s=min(5.0, timeout_s), until=deadline)
            try:
                if resp.status != 200:
                    await self._refuse(resp)
                raw = await resp.read()
            finally:
                resp.release()
        except OSError as exc:   # TimeoutError included
            raise self._failure(exc, started=False) from None
        return self._whole(raw, job)

    async def _stream(
        self, job: GenerationJob, deadline: float, read_s: float, timeout_s: float
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """A streamed request: each read of the stream must come within `read_s` (the first-token
        timeout), and all of them by the deadline."""
        started = False
        try:
            payload = await self._body_with_embeds(job) if self._inline_embeds(job) else self._body(job)
            post = self._pool.post(_path(job), orjson.dumps(payload), self._request_headers(job),
                                   connect_timeout_s=min(5.0, timeout_s))
            resp = await _bounded(post, deadline, read_s)
            try:
                if resp.status != 200:
                    await self._refuse(resp, deadline)
                async for chunk in self._chunks(resp, deadline, read_s, job):
                    started = True
                    yield chunk
            finally:
                resp.release()   # back to the pool when the body was read to its end, else closed
        except OSError as exc:   # TimeoutError included
            raise self._failure(exc, started) from None

    def _request_headers(self, job: GenerationJob) -> tuple[tuple[str, str], ...]:
        if job.traceparent:   # the dispatch's span (or the client's): the upstream's spans join the request's trace
            headers = (*self._headers, ("x-request-id", job.request_id), ("traceparent", job.traceparent))
            return (*headers, ("tracestate", job.tracestate)) if job.tracestate else headers
        return (*self._headers, ("x-request-id", job.request_id))

    def _failure(self, exc: OSError, started: bool) -> BackendFailure:
        """Transport errors → the backend's failure: retryable while nothing reached the client."""
        if isinstance(exc, TimeoutError):
            what = str(exc) if isinstance(exc, _Silent) else "request deadline exceeded"
            return BackendTimeout(f"backend {self.backend_id}: {what}", backend_id=self.backend_id,
                                  retryable=not started)
        # connect errors, resets, an upstream that does not speak HTTP/1.1
        return BackendFailure(f"backend {self.backend_id}: {type(exc).__name__}: {exc}",
                              backend_id=self.backend_id, retryable=not started)

    async def _refuse(self, resp: UpstreamResponse, until: float | None = None) -> None:
        """A response other than 200 → the gateway's error for it (the body read for its message, by
        loop time `until`)."""
        message = _error_message(await resp.read(until))
        raise self._refusal(resp.status, message, retry_after_s=_retry_after_s(resp.headers))

    def _refusal(self, status: int | None, message: str, *, retry_after_s: float | None = None,
                 retryable: bool = True) -> RequestError:
        """The gateway's error for an upstream's refusal with HTTP `status` (a response's, or the `code` of
        an error event in its stream; None: it named none), its `message` and its Retry-After."""
        what = f"backend {self.backend_id}: " + (f"HTTP {status}: {message}" if status else message)
        if status == 429 or (status == 503 and retry_after_s is not None):
            busy = UpstreamRateLimited if status == 429 else UpstreamUnavailable
            wait_s = 1.0 if retry_after_s is None else retry_after_s
            limited = busy(what, backend_id=self.backend_id, retry_after_s=wait_s, said=message)
            limited.retryable = retryable
            return limited
        # 401/403: the gateway's credentials for this backend; 404: a model (`upstream_model`) or route this
        # upstream does not serve, though the gateway routed the model to it; 408: it timed out reading what
        # the gateway sent (the client's body was whole by then). Not the client's request.
        if status is None or not 400 <= status < 500 or status in (401, 403, 404, 408):
            return BackendFailure(what, backend_id=self.backend_id, retryable=retryable)
        return InvalidRequest(f"upstream rejected the request: {message}")

    def _stream_error(self, event: dict[str, Any], first: bool) -> RequestError:
        """An error event in a stream, in either shape `_error_message` reads: vLLM and SGLang send one after
        their 200 with the HTTP status as its `code` (400 for a prompt found too long once streaming), the
        client's error as much as a 400 reply would be: not retried elsewhere, no fault of the backend."""
        error = event.get("error")
        fields = error if isinstance(error, dict) else event
        message = fields.get("message") or (error if isinstance(error, str) else None) or "error"
        code = fields.get("code")
        status = int(code) if isinstance(code, int | str) and str(code).isdigit() else None
        return self._refusal(status, str(message), retryable=first)

    def _whole(self, raw: bytes, job: GenerationJob) -> engine_pb2.GenerateChunk:
        """A non-streamed reply → one chunk carrying the upstream's body as it came, with the gateway's id
        and model swapped in."""
        try:
            reply = orjson.loads(raw)
            choices = reply["choices"]
            first = choices[0]
            text = (first.get("message") or {}).get("content") or first.get("text") or ""
            finish = first.get("finish_reason") or "stop"
            usage = reply.get("usage") or {}
        except (orjson.JSONDecodeError, KeyError, IndexError, AttributeError, TypeError) as exc:
            raise BackendFailure(f"backend {self.backend_id}: malformed reply: {exc!r}",
                                 backend_id=self.backend_id) from None
        relay = _Relay(completion_id(job.kind, job.request_id), self._reply_model(job))
        chunk = engine_pb2.GenerateChunk(text=text, index=0, finish_reason=finish, relay=relay.swapped(raw, reply))
        _read_usage(usage, chunk.usage)
        return chunk

    async def _chunks(
        self, resp: UpstreamResponse, deadline: float, read_s: float | None, job: GenerationJob
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """SSE → chunks, each carrying its upstream events for verbatim relay; the last chunk with a finish
        reason is held back until usage arrives. With several choices (`n`) only that last one ends the
        stream: the finish event of an earlier choice is relayed as is, in a chunk without a finish.

        Events that arrive in one read leave as one chunk (their relays and texts joined): under load a
        fast engine's events come in bursts, and every chunk costs a trip through the pipeline, the
        door and a socket write.
        """
        index, held = 0, None
        relay = _Relay(completion_id(job.kind, job.request_id), self._reply_model(job))
        finished = False
        pending = b""
        loop = asyncio.get_running_loop()
        while True:
            until = deadline if read_s is None else min(deadline, loop.time() + read_s)
            try:
                data = await resp.read_some(until)   # the bound never spans a yield
            except TimeoutError:
                if read_s is not None and until < deadline:
                    raise _Silent.after(read_s) from None
                raise
            if not data:
                break
            # After [DONE] the body is still read to its end: a response closed early takes its
            # connection with it, and the next request pays a new TCP handshake.
            if finished:
                continue
            *lines, pending = (pending + data).split(b"\n")
            batch: list[tuple[str, bytes]] = []
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    finished = True
                    break
                try:
                    text, finish, usage, event = self._event(payload, index == 0)
                except RequestError:   # what came before it in this read reaches the client first
                    if batch:
                        yield _joined(batch, index - 1)
                    raise
                if event is not None:
                    index += 1
                    if finish:
                        if held is not None:   # an earlier choice's end, not the stream's
                            batch.append((held.text, held.relay))
                        if batch:
                            yield _joined(batch, index - 1)
                            batch = []
                        held = engine_pb2.GenerateChunk(text=text, index=index - 1, finish_reason=finish,
                                                        relay=relay.event(payload, event))
                    else:
                        batch.append((text, relay.event(payload, event)))
                if usage and held is not None:
                    _read_usage(usage, held.usage)
            if batch:
                yield _joined(batch, index - 1)
        if held is None:
            raise BackendFailure(f"backend {self.backend_id}: stream ended without a finish reason",
                                 backend_id=self.backend_id, retryable=index == 0)
        if not held.usage.completion_tokens:   # no usage came: the gateway's counts
            held.usage.completion_tokens = index
        if not held.usage.prompt_tokens:
            held.usage.prompt_tokens = job.prompt_tokens + job.image_tokens
        yield held

    def _event(self, payload: bytes, first: bool) -> tuple[str, str, dict[str, Any], dict[str, Any] | None]:
        """One SSE payload → (text, finish reason, usage, the event when it has choices)."""
        try:
            event = orjson.loads(payload)
            if "error" in event or event.get("object") == "error":
                raise self._stream_error(event, first)
            choices: list[Any] = event.get("choices") or []
            if len(choices) == 1:   # the usual event: one choice, read without a pass over a list
                choice = choices[0]
                text, finish = _text(choice), choice.get("finish_reason") or ""
            else:
                text = "".join(_text(c) for c in choices)
                finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), "")
            usage = event.get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError) as exc:
            raise BackendFailure(f"backend {self.backend_id}: malformed event: {exc!r}",
                                 backend_id=self.backend_id, retryable=first) from None
        return text, finish, usage, event if choices else None

    async def close(self) -> None:
        await self._pool.close()


def _read_usage(usage: dict[str, Any], into: engine_pb2.Usage) -> None:
    """An upstream's usage object into the chunk's; its `prompt_tokens_details.cached_tokens` (vLLM with
    `--enable-prompt-tokens-details`, SGLang, OpenAI) kept for the client's usage and the request log."""
    try:
        into.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        into.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(cached := details.get("cached_tokens"), int) and cached >= 0:
            into.cached_tokens = cached
    except (TypeError, ValueError, AttributeError):
        pass   # a malformed usage object: the gateway's counts stand


def _text(choice: dict[str, Any]) -> str:
    """A choice's text: its delta's content (chat) or its text (completions)."""
    delta = choice.get("delta")
    return (delta.get("content") if delta else None) or choice.get("text") or ""


def _path(job: GenerationJob) -> str:
    return "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"


class _OneChunk:
    """The one-chunk stream of a non-streamed exchange, read as the pipeline reads every backend's
    stream (`anext`, then `aclose`). A plain object: an async generator per request is registered
    with the event loop and finalized after, which cost ~5% of a request's CPU in front of a fast
    upstream (docs/FRONT_DOOR.md)."""

    def __init__(self, exchange: Coroutine[Any, Any, engine_pb2.GenerateChunk]) -> None:
        self._exchange: Coroutine[Any, Any, engine_pb2.GenerateChunk] | None = exchange

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> engine_pb2.GenerateChunk:
        exchange, self._exchange = self._exchange, None
        if exchange is None:
            raise StopAsyncIteration
        return await exchange

    async def aclose(self) -> None:
        if self._exchange is not None:   # never read: the exchange never started
            self._exchange.close()
            self._exchange = None


class _Silent(TimeoutError):
    """The upstream sent nothing for longer than a read may take (before the request's deadline)."""

    @classmethod
    def after(cls, read_s: float) -> _Silent:
        return cls(f"no data from the upstream within {read_s:g} s")


async def _bounded(wait: Awaitable[T], deadline: float, read_s: float | None) -> T:
    """`wait`, within the request's deadline and, when `read_s` is set, within `read_s` from now."""
    if read_s is None or asyncio.get_running_loop().time() + read_s >= deadline:
        async with asyncio.timeout_at(deadline):
            return await wait
    try:
        async with asyncio.timeout(read_s):
            return await wait
    except TimeoutError:
        raise _Silent.after(read_s) from None


def _joined(batch: list[tuple[str, bytes]], last_index: int) -> engine_pb2.GenerateChunk:
    if len(batch) == 1:
        text, relay = batch[0]
    else:
        text, relay = "".join(t for t, _ in batch), b"".join(r for _, r in batch)
    return engine_pb2.GenerateChunk(text=text, index=last_index, relay=relay)
